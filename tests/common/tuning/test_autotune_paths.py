"""autotune on a dataset with thread paths (issue 39): the paths are measured beside the step,
the chosen one is stored, and `make_loader`'s "auto" takes it with the reason."""

import time

import pytest
import torch

from recipes.common import ThreadLoader, autotune, make_loader
from recipes.common.loading.isolated_loader import IsolatedLoader
from recipes.common.sizing.tune_store import load_tuned
from recipes.common.tuning.tune_choice import choose_trial


def _spin(seconds: float) -> None:
    """`seconds` of this thread's CPU in pure Python (the GIL held, as an eager step's kernel
    launches hold it): a fixed amount of work, which takes longer when another thread of the
    process holds the GIL meanwhile (a spin on the wall clock would not)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Held:
    """Thread-batched records whose batch costs `cost` seconds of Python (the GIL held): threads
    of the loop's process share one GIL with the step, a child process has its own."""

    def __init__(self, n: int = 96, cost: float = 0.006):
        self.n, self.cost = n, cost

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.read_batch([i], None)

    def thread_batches(self):
        return True

    def read_batch(self, indices, rng):
        _spin(self.cost)
        return {"ids": torch.tensor(indices, dtype=torch.int64)}

    def __repr__(self):
        return f"Held(n={self.n}, cost={self.cost})"


def _step_holding(seconds):
    def step(batch):
        _spin(seconds)

    return step


@pytest.mark.slow  # 4-7 s of timed trials beside a step: in the full suite (CI)
def test_a_step_holding_the_gil_gets_the_isolated_path_and_make_loader_takes_it():
    """Beside a step of 18 ms of Python, batches of 6 ms of Python made in the loop's process
    (0 workers, or its threads) add their time to the step's: a wait of about a quarter. The
    child's threads make them beside it, on the other core: fed, with one process fewer than
    a worker (the cheapest fed setting wins, or on a busy machine the fastest)."""
    ds = Held()
    result = autotune(
        ds, batch_size=8, step=_step_holding(0.018), seconds_per_trial=0.4, max_workers=2
    )
    paths = [t["path"] for t in result.trials]
    assert paths[:3] == ["threads", "isolated", "workers"], result.table()  # the thread paths first
    assert result == {"batch_size": 8, "path": "isolated"}, result.table()
    rows = {t["path"]: t for t in result.trials if t["num_workers"] == 0}
    # The threads of the loop's process may wait little: their cost is the step's own time (the
    # GIL), about a quarter of it; the child's cost the step a few points (its hand-over).
    assert rows["isolated"]["kept"] > rows["threads"]["kept"] + 0.1, result.table()
    assert "| isolated | - | - |" in result.table() and "the step step()" in (result.step or "")

    record = load_tuned(Held())  # an equal dataset finds it, with the reason and the step
    assert record["settings"] == dict(result) and record["reason"] == result.reason
    loader = make_loader(Held(), batch_size=8)
    assert (
        isinstance(loader, IsolatedLoader) and not loader.adaptive
    )  # measured with the step: no probe
    why = loader.recipe.reasons["path"]
    assert (
        why.startswith("threads of one child process")
        and "autotuned" in why
        and "beside the step" in why
    )
    ids = torch.cat([b["ids"] for b in loader]).tolist()
    assert sorted(ids) == list(range(96)) and len(ids) == 96  # it reads the epoch, each once
    loader.close()
    # The user's choice wins over the measured one, and tuned=False returns to the rules.
    assert type(make_loader(Held(), batch_size=8, path="threads")) is ThreadLoader
    assert "autotuned" not in make_loader(Held(), batch_size=8, tuned=False).recipe.reasons["path"]
    assert (
        "autotuned" not in make_loader(Held(), batch_size=16).recipe.reasons["path"]
    )  # another batch size


def test_workers_measured_best_are_taken_by_auto_on_a_thread_capable_dataset(tmp_path):
    """A stored worker setting (a slow step: 0 workers feed it, the cheapest) is applied by
    "auto" for a dataset that would otherwise take threads."""
    ds = Held(n=48, cost=0.0002)
    result = autotune(ds, batch_size=8, step_seconds=0.05, seconds_per_trial=0.2, max_workers=1)
    assert result == {"batch_size": 8, "num_workers": 0, "path": "workers"}, result.table()
    assert "a simulated step of 50 ms" == result.step
    loader = make_loader(Held(n=48, cost=0.0002), batch_size=8)
    assert not isinstance(loader, ThreadLoader) and loader.num_workers == 0
    assert loader.recipe.reasons["path"].startswith("worker processes: autotuned")
    assert sorted(torch.cat([b["ids"].flatten() for b in loader]).tolist()) == list(range(48))
    # A thread argument keeps the thread path: the stored workers could not take it.
    kept = make_loader(Held(n=48, cost=0.0002), batch_size=8, threads=2)
    assert isinstance(kept, ThreadLoader) and "autotuned" not in kept.recipe.reasons["path"]


def _row(path, wait, rate, workers=0, prefetch=None, peak=1):
    return {
        "path": path,
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "samples_per_s": rate,
        "wait_fraction": wait,
        "peak_bytes": peak,
    }


@pytest.mark.parametrize(
    ("rows", "with_step", "budget", "expected"),
    [
        # fed: fewer processes win (threads of this process, then the child, then one worker)
        (
            [_row("isolated", 0.02, 900), _row("threads", 0.05, 700), _row("workers", 0.3, 300)],
            True,
            None,
            "threads",
        ),
        (
            [
                _row("isolated", 0.02, 900),
                _row("threads", 0.25, 700),
                _row("workers", 0.08, 500, 1, 2),
            ],
            True,
            None,
            "isolated",
        ),
        # none fed: the fastest; within 5% of it, the cheapest
        (
            [
                _row("isolated", 0.2, 1000),
                _row("threads", 0.3, 960),
                _row("workers", 0.4, 600, 2, 2),
            ],
            True,
            None,
            "threads",
        ),
        (
            [
                _row("isolated", 0.2, 1000),
                _row("threads", 0.3, 900),
                _row("workers", 0.4, 600, 2, 2),
            ],
            True,
            None,
            "isolated",
        ),
        (
            [
                _row("isolated", None, 1000),
                _row("threads", None, 700),
                _row("workers", None, 1040, 2, 2),
            ],
            False,
            None,
            "isolated",
        ),
        # over the memory budget: never chosen
        (
            [_row("isolated", 0.02, 900, peak=10), _row("threads", 0.2, 700, peak=5)],
            True,
            8,
            "threads",
        ),
    ],
)
def test_the_choice_between_paths(rows, with_step, budget, expected):
    assert choose_trial(rows, with_step, budget)["path"] == expected
