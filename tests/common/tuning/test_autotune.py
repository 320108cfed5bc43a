import json
import os
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from recipes.common import autotune, make_loader
from recipes.common.loader_warning import LoaderWarning
from recipes.common.sizing.tune_store import load_tuned, tune_dir


class Busy(Dataset):
    """CPU-bound items: `cost` seconds of pure-Python work each (holds a core, like a decode),
    and `item_bytes` of payload."""

    def __init__(self, n=64, cost=0.004, item_bytes=1024):
        self.n, self.cost, self.item_bytes = n, cost, item_bytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        end = time.perf_counter() + self.cost
        x = 0
        while time.perf_counter() < end:
            x += 1
        return torch.full((self.item_bytes,), i % 251, dtype=torch.uint8)

    def __repr__(self):
        return f"Busy(n={self.n}, cost={self.cost}, item_bytes={self.item_bytes})"


def _tune(ds, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("seconds_per_trial", 0.3)  # each setting is measured twice, in turns
    kw.setdefault("max_workers", 2)
    return autotune(ds, **kw)


def _rate(result, workers, prefetch=None):
    rows = [
        t
        for t in result.trials
        if t["num_workers"] == workers and (prefetch is None or t["prefetch_factor"] == prefetch)
    ]
    return max(t["samples_per_s"] for t in rows)


@pytest.fixture(scope="module")
def busy_tuned():
    """One free tune of CPU-bound data, shared by the tests that read it."""
    return _tune(Busy(), store=False)


@pytest.mark.slow  # about 6 s of timed trials: in the full suite (CI)
def test_cpu_bound_data_gets_more_than_one_worker_and_beats_zero(busy_tuned):
    result = busy_tuned
    assert result["num_workers"] > 1
    assert _rate(result, result["num_workers"]) > 1.3 * _rate(result, 0)
    assert result["batch_size"] == 8 and result["prefetch_factor"] in (1, 2, 4)
    loader = make_loader(Busy(), **result)  # the settings are make_loader's own
    assert loader.num_workers == result["num_workers"]
    assert "| workers | prefetch |" in result.table()


# a long run (6 s), timing-bound: in the full suite (CI); the default run keeps headroom
@pytest.mark.slow
def test_a_slow_step_needs_fewer_workers_than_a_fast_one(busy_tuned):
    fast = busy_tuned
    slow = _tune(
        Busy(), step_seconds=0.15, store=False, seconds_per_trial=0.45
    )  # a batch takes ~32 ms of CPU to make
    assert slow["num_workers"] < fast["num_workers"]
    chosen = next(
        t
        for t in slow.trials
        if (t["num_workers"], t["prefetch_factor"])
        == (slow["num_workers"], slow.get("prefetch_factor"))
    )
    assert chosen["wait_fraction"] < 0.10
    assert "data wait is under 10%" in slow.reason


TIGHT_BUDGET = r"""
import sys
sys.path.insert(0, sys.argv[1])
from tests.common.tuning.test_autotune import Busy, _tune

ds = Busy(n=64, cost=0.004, item_bytes=8 << 20)  # 64 MiB batches: each worker holds several (a PSS
# peak is noisy by tens of MiB on a busy machine, run to run; two workers hold about 128 MiB more)
# peaks are sampled every 0.25 s: longer trials
free = _tune(ds, store=False, seconds_per_trial=1.0)
peaks = {
    t["num_workers"]: t["peak_bytes"] for t in free.trials if t["prefetch_factor"] in (None, 2)
}
# The sweep always reaches 2 workers, whose batches stand clear of 0 and 1 worker. Those two are
# not ordered: 0 workers make a batch in the main process (items and the collated copy), 1 worker
# hands it over in shared memory, and a 0.25 s sampler sees about the same (CI: 440 vs 438 MB).
assert peaks[2] > max(peaks[0], peaks[1]), peaks
budget = (peaks[1] + peaks[2]) // 2
tight = _tune(ds, memory_budget=budget, store=False, seconds_per_trial=1.0)
# Whatever the rates on a busy machine say, the choice fits: not 2 workers with 2 batches
# each. (2 workers with prefetch_factor=1 hold fewer batches and may fit: measured once.)
assert (tight["num_workers"], tight.get("prefetch_factor")) != (2, 2), tight.table()
chosen = [t for t in tight.trials if (t["num_workers"], t["prefetch_factor"]) ==
          (tight["num_workers"], tight.get("prefetch_factor"))]
assert chosen[0]["peak_bytes"] <= budget, tight.table()
over = [t for t in tight.trials if t["peak_bytes"] > budget]
# the budget ruled settings out
assert over and all(t is not chosen[0] for t in over), tight.table()
assert "within the memory budget" in tight.reason
"""


# a long run (23 s): 2 sweeps of 1 s trials; the no-fit budget case runs in the fast tier
@pytest.mark.slow
def test_a_tight_memory_budget_picks_fewer_workers(zygote, tmp_path):
    """In a fresh process (the zygote's child): the peaks include the main process, whose heap
    in a long test session moves by more than a worker's batches."""
    from pathlib import Path

    child = zygote.python(
        TIGHT_BUDGET,
        str(Path(__file__).parents[3]),
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert child.wait(timeout=300) == 0, child.stderr


def test_the_result_is_stored_and_reused_by_make_loader():
    ds = Busy(n=32)
    result = _tune(ds, max_workers=1)
    record = load_tuned(Busy(n=32))  # an equal dataset finds it
    assert record["settings"] == dict(result)
    loader = make_loader(Busy(n=32), batch_size=8)
    assert loader.num_workers == result["num_workers"]
    assert loader.recipe.reasons["num_workers"].startswith("autotuned")
    # Another batch size, an explicit override, or tuned=False: not applied.
    assert "autotuned" not in make_loader(Busy(n=32), batch_size=16).recipe.reasons["num_workers"]
    assert make_loader(Busy(n=32), batch_size=8, num_workers=0).num_workers == 0
    assert (
        "autotuned"
        not in make_loader(Busy(n=32), batch_size=8, tuned=False).recipe.reasons["num_workers"]
    )
    assert load_tuned(Busy(n=33)) is None  # another dataset


def test_a_damaged_store_is_ignored(tmp_path):
    ds = Busy(n=16)
    _tune(ds, seconds_per_trial=0.2, max_workers=1)
    (path,) = tune_dir().glob("*.json")
    path.write_text("{not json")
    assert load_tuned(ds) is None
    path.write_text(json.dumps({"version": 999, "settings": {}}))
    assert load_tuned(ds) is None
    assert "autotuned" not in make_loader(ds, batch_size=8).recipe.reasons["num_workers"]


def test_bad_arguments():
    with pytest.raises(
        ValueError, match="`batch_size` must be a positive integer, but is 0 instead."
    ):
        autotune(Busy(), batch_size=0)
    with pytest.raises(ValueError, match="`memory_budget` must be positive"):
        autotune(Busy(), batch_size=4, memory_budget=0)
    with pytest.raises(ValueError, match="empty"):
        autotune(Busy(n=0), batch_size=4)


def test_iterable_datasets_are_tuned_too():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            start, step = (0, 1) if info is None else (info.id, info.num_workers)
            for i in range(start, 40, step):
                yield np.float32(i)

    result = _tune(Stream(), seconds_per_trial=0.2, store=False)
    assert result["num_workers"] in (0, 1, 2)


def test_no_setting_within_the_budget_is_said_warned_and_not_stored():
    ds = Busy(n=16)
    with pytest.warns(LoaderWarning, match="no setting fits the memory budget of 0 MiB"):
        result = _tune(ds, seconds_per_trial=0.1, max_workers=1, memory_budget=1)
    assert (
        "no setting fits the memory budget" in result.reason
        and "within the memory budget" not in result.reason
    )
    assert load_tuned(ds) is None


def test_worker_limits_and_a_sweep_cut_short():
    single = _tune(Busy(n=16), seconds_per_trial=0.1, max_workers=0, store=False)
    assert [(t["num_workers"], t["prefetch_factor"]) for t in single.trials] == [
        (0, None)
    ]  # one row, no duplicate
    with pytest.raises(ValueError, match="`max_workers` must be a non-negative integer, but is -1"):
        autotune(Busy(), batch_size=4, max_workers=-1)
    with pytest.raises(ValueError, match="positive and finite"):
        autotune(Busy(), batch_size=4, seconds_per_trial=float("inf"))
    ds = Busy(n=16)
    with pytest.warns(LoaderWarning, match="allowed one trial"):
        cut = _tune(ds, seconds_per_trial=0.1, max_seconds=0.001)
    assert "measured once: max_seconds ran out" in cut.reason and load_tuned(ds) is None
