"""One trial of `autotune`: a loader setting measured beside the step, and the step alone.

Use when: you want the figures of one setting as `autotune` takes them (samples/s, the loop's
data wait, the peak memory of the process tree), or to fold a second run into the first.
Cost: one `make_loader` loader read for `seconds` after its first batch (worker start-up and the
first decode are not steady state), with a PSS reading of the process tree every 250 ms.
Adapt here: `run_trial` (what a trial reads and records), `measure_step_alone`.
Trade-off: a map-style dataset is read in index order, repeated (`_Endless`), so a trial never
waits on an epoch boundary; the order a training run uses (shuffled) may read slower storage.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py, common/loader_warning.py,
  common/loading/batch_ring.py, common/loading/epoch_read_ahead.py,
  common/loading/isolated/child.py, common/loading/isolated/protocol.py,
  common/loading/isolated_loader.py, common/loading/loader.py, common/loading/loader_path.py,
  common/loading/loader_rules.py, common/loading/loop_probe.py, common/loading/stateful_loader.py,
  common/loading/thread_loader.py, common/loading/worker_rules.py, common/remote/cache_download.py,
  common/remote/object_download.py, common/remote/object_urls.py, common/remote/prefetch_cache.py,
  common/remote/process_downloads.py, common/remote/ranged_download.py, common/remote/retries.py,
  common/resume/batch_seeds.py, common/resume/dataset_state.py, common/resume/elastic_rest.py,
  common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sampling/elastic_sampler.py, common/sampling/sharding.py,
  common/sizing/profiles.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/sizing/tune_store.py, common/tuning/monitor.py, common/tuning/monitor_epoch.py,
  common/tuning/monitor_plot.py, common/tuning/monitor_rules.py, common/tuning/probes.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py,
  common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset, Sampler

from recipes.common.loading.loader import make_loader
from recipes.common.tuning.monitor import items_in
from recipes.common.tuning.probes import PeakMemory


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one `autotune` run shares: the data, the batch and the step."""

    dataset: Any
    batch_size: int
    collate_fn: Callable | None
    stepper: Callable[[Any], Any] | None  # called on every batch; None: no step
    seconds: float  # measuring time per trial, after its first batch


def run_trial(
    setup: TrialSetup,
    workers: int,
    prefetch: int | None,
    path: str = "workers",
    sample: list | None = None,
) -> dict[str, Any]:
    """One setting measured beside `setup.stepper`; its first batch goes to `sample` when that
    is empty. Returns the trial's row: `path`, `num_workers`, `prefetch_factor`,
    `samples_per_s`, `wait_fraction` (None without a step) and `peak_bytes`."""
    loader = make_loader(
        setup.dataset,
        profile="production",
        batch_size=setup.batch_size,
        **_loader_arguments(setup, workers, prefetch, path),
    )
    with PeakMemory(interval=0.25) as memory:
        batches = _endless_batches(loader)
        first = next(batches)  # start-up (worker spawn, first decode) is not steady state
        if sample is not None and not sample:
            sample.append(first)
        del first
        samples = 0
        wait = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < setup.seconds:
            asked = time.perf_counter()
            batch = next(batches)
            wait += time.perf_counter() - asked
            samples += items_in(batch)
            if setup.stepper is not None:
                setup.stepper(batch)
        elapsed = time.perf_counter() - start
        batches.close()
        close = getattr(loader, "close", None)
        # the isolated path's child, the thread pool: gone before the next trial
        if close is not None:
            close()
        del loader
    wait_fraction = None
    if setup.stepper is not None:
        wait_fraction = wait / elapsed
    return {
        "path": path,
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "samples_per_s": samples / elapsed,
        "wait_fraction": wait_fraction,
        "peak_bytes": memory.peak,
    }


def _loader_arguments(
    setup: TrialSetup, workers: int, prefetch: int | None, path: str
) -> dict[str, Any]:
    """`make_loader`'s arguments for one trial (never a stored result: `tuned=False`)."""
    kwargs: dict[str, Any] = {"path": path, "tuned": False}
    if path == "workers":
        kwargs = {"num_workers": workers, "tuned": False}
    if setup.collate_fn is not None:
        kwargs["collate_fn"] = setup.collate_fn
    if workers:
        kwargs.update(prefetch_factor=prefetch, persistent_workers=False)
    if not isinstance(setup.dataset, IterableDataset):
        kwargs["sampler"] = _Endless(len(setup.dataset))
    return kwargs


def measure_step_alone(stepper: Callable[[Any], Any], batch, seconds: float) -> float:
    """The step's samples/s on one batch, no loader beside it: what a loader that costs the
    loop nothing would keep (a loader in the loop's process slows the step itself when both
    need the GIL, which its data wait does not show)."""
    stepper(batch)  # a first call's one-off costs (allocations, a compile) are not the step's rate
    steps = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or steps < 3:
        stepper(batch)
        steps += 1
    return steps * items_in(batch) / elapsed


def set_kept(trials: list[dict[str, Any]], alone: float) -> None:
    """Each trial's rate as a share of the step's alone (`kept`), None without a step."""
    for row in trials:
        row["kept"] = None
        if alone > 0:
            row["kept"] = min(1.0, row["samples_per_s"] / alone)


def merge_rerun(row: dict[str, Any], again: dict[str, Any]) -> None:
    """`again` folded into `row`: the faster run's rate and wait, the higher peak (memory is a
    limit)."""
    if again["samples_per_s"] > row["samples_per_s"]:
        row.update(samples_per_s=again["samples_per_s"], wait_fraction=again["wait_fraction"])
    row["peak_bytes"] = max(row["peak_bytes"], again["peak_bytes"])
    row["runs"] = row.get("runs", 1) + 1


def sleeper(seconds: float) -> Callable[[Any], None]:
    """A simulated step: sleeps `seconds` per batch."""

    def step(_batch) -> None:
        time.sleep(seconds)

    return step


def _endless_batches(loader) -> Iterator:
    while True:  # an iterable dataset shorter than a trial is read again
        got = False
        for batch in loader:
            got = True
            yield batch
        if not got:
            raise ValueError("autotune: the dataset yielded no batch; it is empty.")


class _Endless(Sampler):
    """Indices 0..n-1 in order, repeated: trials never wait on an epoch boundary."""

    def __init__(self, n: int):
        if n <= 0:
            raise ValueError("autotune: the dataset is empty.")
        self.n = n

    def __iter__(self):
        while True:
            yield from range(self.n)

    def __len__(self) -> int:
        return 1 << 62
