import pytest


@pytest.fixture(autouse=True)
def _private_tune_store(tmp_path_factory, monkeypatch):
    """Tuning results stored by one test never reach another test's make_loader, nor the
    developer's own ~/.cache/recipes/tune."""
    monkeypatch.setenv("RECIPES_TUNE_DIR", str(tmp_path_factory.mktemp("tune")))
