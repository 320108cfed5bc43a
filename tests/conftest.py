import gc
import weakref

import pytest
from torch.utils.data import DataLoader


@pytest.fixture(autouse=True)
def _private_tune_store(tmp_path_factory, monkeypatch):
    """Tuning results stored by one test never reach another test's make_loader, nor the
    developer's own ~/.cache/recipes/tune."""
    monkeypatch.setenv("RECIPES_TUNE_DIR", str(tmp_path_factory.mktemp("tune")))


@pytest.fixture(autouse=True)
def _loaders_closed_in_teardown(monkeypatch):
    """A test's worker processes end with the test. Persistent workers otherwise end at the
    next garbage collection, inside some later test, which is then charged their shutdown (a
    1 s test took 20 s after a make_loader test) and competes with them for the 2 cores."""
    created = weakref.WeakSet()
    init = DataLoader.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.add(self)

    monkeypatch.setattr(DataLoader, "__init__", tracking_init)
    yield
    with_workers = [loader for loader in created if loader.num_workers]
    for loader in with_workers:
        iterator = loader.__dict__.get("_iterator")
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
    if with_workers:
        del with_workers
        gc.collect()  # iterators the test dropped inside reference cycles shut their workers down now
