import gc
import weakref

import pytest
from torch.utils.data._utils import signal_handling
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter


@pytest.fixture(autouse=True)
def _private_tune_store(tmp_path_factory, monkeypatch):
    """Tuning results stored by one test never reach another test's make_loader, nor the
    developer's own ~/.cache/recipes/tune."""
    monkeypatch.setenv("RECIPES_TUNE_DIR", str(tmp_path_factory.mktemp("tune")))


@pytest.fixture(autouse=True)
def _loaders_closed_in_teardown(monkeypatch):
    """A test's worker processes end with the test. Otherwise they end when their iterator is
    garbage collected, inside some later test, which is then charged their shutdown (a 1 s
    test took 20 s after a make_loader test) and competes with them for the 2 cores. An
    iterator a test abandoned after a worker error takes PyTorch 5 s to shut down (its join
    times out before it terminates the worker), so leftover workers are killed first."""
    created = weakref.WeakSet()
    init = _MultiProcessingDataLoaderIter.__init__

    def tracking_init(self, *args, **kwargs):
        created.add(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "__init__", tracking_init)
    yield
    live = [iterator for iterator in created if not getattr(iterator, "_shutdown", True)]
    for iterator in live:
        if getattr(
            iterator, "_worker_pids_set", False
        ):  # a killed worker is expected now: no SIGCHLD error
            signal_handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        for worker in getattr(iterator, "_workers", []):
            if worker.is_alive():
                worker.kill()
        iterator._shutdown_workers()
    if live:
        del live
        gc.collect()  # what the test dropped inside reference cycles goes now, not in a later test


@pytest.fixture(scope="session")
def zygote():
    """`zygote.python(code, *argv)`: a Python process with torch and recipes.common imported,
    forked in milliseconds from one fresh interpreter (tests/zygote.py says what differs)."""
    from tests.zygote import Zygote

    server = Zygote(["numpy", "torch", "recipes.common"])
    yield server
    server.close()
