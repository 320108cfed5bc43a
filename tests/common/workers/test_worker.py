"""worker_init inside real forked DataLoader workers."""

import gc
import multiprocessing
import random

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.common import worker_init


class Probe(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {
            "worker": info.id,
            "cv2_threads": cv2.getNumThreads(),
            "opencl": int(cv2.ocl.useOpenCL()),
            "torch_threads": torch.get_num_threads(),
            "numpy": float(np.random.rand()),
            "random": random.random(),
            "frozen": gc.get_freeze_count(),
        }


def _run(**kw):
    loader = DataLoader(
        Probe(),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
        **kw,
    )
    return list(loader)


def test_opencv_runs_single_threaded_in_forked_workers():
    cv2.setNumThreads(2)  # the parent uses a thread pool before the fork
    try:
        rows = _run(worker_init_fn=worker_init)
    finally:
        cv2.setNumThreads(-1)
    assert {r["worker"] for r in rows} == {0, 1}
    assert {r["cv2_threads"] for r in rows} == {1}
    assert {r["opencl"] for r in rows} == {0}
    assert {r["torch_threads"] for r in rows} == {1}


def test_forked_workers_keep_the_parents_objects_out_of_their_collections():
    parent = gc.get_freeze_count()
    rows = _run(worker_init_fn=worker_init)
    assert all(r["frozen"] > 10_000 for r in rows), [
        r["frozen"] for r in rows
    ]  # pytest's heap, inherited
    assert gc.get_freeze_count() == parent
    assert min(r["frozen"] for r in _run()) == parent  # without worker_init nothing is set aside


def test_numpy_and_random_draws_differ_across_workers():
    np.random.seed(0)  # identical global state in the parent, copied by fork
    random.seed(0)
    rows = _run(worker_init_fn=worker_init)
    by_worker = {w: [r for r in rows if r["worker"] == w][0] for w in (0, 1)}
    assert by_worker[0]["numpy"] != by_worker[1]["numpy"]
    assert by_worker[0]["random"] != by_worker[1]["random"]


def test_draws_are_reproducible_with_a_seeded_generator():
    def draws():
        g = torch.Generator().manual_seed(7)
        return [r["numpy"] for r in _run(worker_init_fn=worker_init, generator=g)]

    assert draws() == draws()


def test_worker_init_in_the_main_process_is_harmless(monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    before, frozen = torch.get_num_threads(), gc.get_freeze_count()
    try:
        worker_init(0)
        assert torch.get_num_threads() == 1
        assert gc.get_freeze_count() == frozen  # the loop's own objects stay collectable
    finally:
        torch.set_num_threads(before)
        cv2.setNumThreads(-1)


LAZY = """
import sys
import torch
from torch.utils.data import DataLoader
from recipes.common import worker_init

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        imported_before = "cv2" in sys.modules
        import cv2  # first use, inside the worker
        return torch.tensor([int(imported_before), cv2.getNumThreads(), int(cv2.ocl.useOpenCL())])

assert "cv2" not in sys.modules
rows = torch.cat(list(DataLoader(Probe(), batch_size=2, num_workers=2, worker_init_fn=worker_init,
                                 multiprocessing_context="fork")))
print(rows.tolist())
"""


@pytest.mark.slow  # 6 s
def test_workers_that_import_opencv_later_are_single_threaded_too():
    """worker_init does not import cv2 when the parent never did, and a later import is
    single-threaded."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # each worker's first item found cv2 not yet imported; every item saw one thread, no OpenCL
    assert out.stdout.strip().splitlines()[-1] == str([[0, 1, 0], [1, 1, 0]] * 2)
