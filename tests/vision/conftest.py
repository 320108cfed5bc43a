import pytest

from recipes.testing import make_image_folder


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory):
    """3 classes x 4 ImageNet-like JPEGs (about 500x375), read-only for tests."""
    return make_image_folder(tmp_path_factory.mktemp("images"), classes=3, per_class=4, seed=5)


@pytest.fixture
def own_tree(tmp_path):
    """A small tree a test may modify."""
    return make_image_folder(tmp_path / "tree", classes=2, per_class=3, seed=6)
