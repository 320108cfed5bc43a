"""`autotune`: measure the loader's paths, `num_workers` x `prefetch_factor` on this machine, keep
the cheapest that feeds the step.

Use when: the GPU waits for data and you do not know how many workers the data needs, or
whether threads of this process, threads of a child process or workers feed your step. The
"4 workers per GPU" rule left a resnet50 step on a 16-core H200 node waiting 70% of the time;
the right number depends on the decode cost, the step time and the cores, so measure it.
Cost: two short trials per setting (`seconds_per_trial`, first batch excluded, 1-3 s each);
a sweep over workers 0, 1, 2, 3, 4, 6, 8, 12, 16... up to the CPUs of this rank stops as soon
as more workers stop helping, then prefetch factors 1 and 4 are tried at the best count, then
every setting is measured again in reverse order and the better of its two runs is kept.
A dataset that makes batches in threads (`thread_batches()`) has its thread paths measured
first: threads of this process and of one child process (`path="threads"`, `"isolated"`);
beside your real step (`step=`), whose Python holds the GIL, they differ (`recipes bench step`).
With a step, the step alone is measured too (on the first batch, twice). Memory is the peak PSS of
the main process and its workers during each trial. Adapt here: `_worker_counts`, `GAIN` (what
counts as "helping"), `WAIT_TARGET`. Trade-off: trials are short, so figures carry ~5-10% noise (the
second round keeps one burst of background work from deciding); a dataset whose cost changes over an
epoch (cache warming) is tuned as it is now. Results are stored per dataset, batch size and machine,
and `make_loader` reuses them.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py, common/loader_warning.py,
  common/loading/batch_ring.py, common/loading/epoch_read_ahead.py,
  common/loading/isolated_loader.py, common/loading/loader.py, common/loading/loader_path.py,
  common/loading/loop_probe.py, common/loading/stateful_loader.py, common/loading/thread_loader.py,
  common/remote/cache_download.py, common/remote/object_download.py, common/remote/object_urls.py,
  common/remote/prefetch_cache.py, common/remote/process_downloads.py,
  common/remote/ranged_download.py, common/remote/retries.py, common/resume/batch_seeds.py,
  common/resume/dataset_state.py, common/resume/elastic_rest.py, common/resume/loader_contract.py,
  common/resume/loader_counting.py, common/resume/loader_passes.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sampling/elastic_sampler.py, common/sampling/sharding.py,
  common/sizing/profiles.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/sizing/tune_store.py, common/tuning/monitor.py, common/tuning/monitor_plot.py,
  common/tuning/probes.py, common/workers/held_descriptors.py, common/workers/process_lifetime.py,
  common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, Sampler

from recipes.common.loader_warning import LoaderWarning
from recipes.common.sizing.tune_store import save_tuned
from recipes.common.tuning.monitor import items_in
from recipes.common.tuning.probes import PeakMemory

GAIN = 1.05  # a setting helps when it is at least 5% faster than the best so far
WAIT_TARGET = 0.10  # with a step: the cheapest setting whose data wait is under 10%


class TuneResult(dict):
    """The chosen `make_loader` settings (`batch_size`, and `path` for a dataset with thread
    paths, or `num_workers`, `prefetch_factor`, `persistent_workers`), with every trial in
    `.trials`, the chosen one in `.chosen` and the table in `.table()`."""

    def __init__(
        self,
        settings: dict[str, Any],
        trials: list[dict[str, Any]],
        reason: str,
        chosen: dict[str, Any] | None = None,
    ):
        super().__init__(settings)
        self.trials = trials
        self.reason = reason
        self.chosen = chosen
        self.step: str | None = (
            None  # what the trials ran beside, in words (stored with the result)
        )

    def table(self) -> str:
        lines = [
            "| path | workers | prefetch | samples/s | data wait | of the step alone | peak "
            "memory (MiB) | chosen |",
            "|:---|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for t in self.trials:
            mark = "yes" if self.chosen is not None and _key(t) == _key(self.chosen) else ""
            wait = "-" if t["wait_fraction"] is None else f"{t['wait_fraction']:.0%}"
            workers = "-" if t["path"] != "workers" else t["num_workers"]
            kept = "-" if t.get("kept") is None else f"{t['kept']:.0%}"
            lines.append(
                f"| {t['path']} | {workers} | {t['prefetch_factor'] or '-'} | "
                f"{t['samples_per_s']:,.1f} | {wait} | {kept} | {t['peak_bytes'] / 2**20:,.0f} | "
                f"{mark} |"
            )
        return "\n".join(lines) + f"\n\n{self.reason}"


def autotune(
    dataset,
    *,
    batch_size: int,
    collate_fn: Callable | None = None,
    step: Callable[[Any], Any] | None = None,
    step_seconds: float = 0.0,
    memory_budget: int | None = None,
    seconds_per_trial: float = 2.0,
    max_seconds: float = 120.0,
    max_workers: int | None = None,
    store: bool = True,
    log: Callable[[str], None] | None = None,
) -> TuneResult:
    """Measures loader settings on this machine and returns the cheapest good one.

    Without a step, the fastest setting wins (the cheapest within 5% of the best: fewer
    processes first). With `step(batch)` (your real training step) or `step_seconds` (a
    simulated one), the cheapest setting whose data wait is under 10% and that keeps the step
    at 90% of its rate alone or more wins (threads of the loop's process slow the step itself
    when both need the GIL, which no data wait shows); when none does, the fastest. Settings whose
    peak memory exceeds `memory_budget` are never chosen. A dataset with thread paths
    (`thread_batches()` true) has them measured too: threads of this process and of one child
    process (`path="threads"`, `"isolated"`) before the workers.

    Args:
        dataset: a map-style or iterable Dataset.
        batch_size: samples per batch.
        collate_fn: the loader's collate function.
        step: called on every batch of a trial, as training would.
        step_seconds: a simulated step (sleep) when `step` is None.
        memory_budget: bytes the loader (main process plus workers, PSS) may use at peak.
        seconds_per_trial: measuring time per setting, after its first batch.
        max_seconds: the whole sweep's budget; trials stop when it is spent.
        max_workers: the largest worker count tried; the CPUs of this rank when None.
        store: save the result so `make_loader` reuses it for this dataset and machine.
        log: called with a line per trial (e.g. `print`).

    Returns:
        A `TuneResult`: `make_loader(dataset, **result)` applies it.

    Raises:
        ValueError: invalid arguments or an empty dataset.
    """
    _check(batch_size, step_seconds, seconds_per_trial, max_seconds, memory_budget, max_workers)
    from recipes.common.sizing.resources import detect_resources
    from recipes.common.sizing.sizing import local_world_size_from_env

    res = detect_resources()
    limit = (
        max_workers if max_workers is not None else max(1, res.cpus // local_world_size_from_env())
    )
    deadline = time.monotonic() + max_seconds
    stepper = step if step is not None else (_sleeper(step_seconds) if step_seconds > 0 else None)
    trials: list[dict[str, Any]] = []
    sample: list = []  # the first batch of the first trial: the step alone is measured on it
    alone = [0.0]  # the step's own rate (samples/s) without a loader, the best of its measures

    def trial(workers: int, prefetch: int | None, path: str = "workers") -> dict[str, Any]:
        row = _trial(
            dataset,
            batch_size,
            collate_fn,
            workers,
            prefetch,
            stepper,
            seconds_per_trial,
            path,
            sample,
        )
        trials.append(row)
        if stepper is not None and not alone[0]:
            alone[0] = _step_alone(stepper, sample[0], seconds_per_trial / 2)
        _kept(trials, alone[0])
        if log is not None:
            wait = row["wait_fraction"]
            if wait is not None:
                wait = round(wait, 3)
            log(
                f"{_label(row)}: {row['samples_per_s']:,.1f} samples/s, wait {wait}, "
                f"peak {row['peak_bytes'] / 2**20:,.0f} MiB"
            )
        return row

    paths = _thread_paths(dataset)
    for name in paths:  # fed beside the step, one leaves the workers only 0 of them to be cheaper
        trial(0, None, name)
    best = trial(0, None)
    cut = False  # the deadline stopped the sweep before it tried one worker count
    for workers in _worker_counts(limit):
        if stepper is not None and any(_fed(t) for t in trials):
            break  # fed already: more workers cost more
        if time.monotonic() > deadline:
            cut = len(trials) == 1 + len(paths)
            break
        row = trial(workers, 2)
        if _over(row, memory_budget) or (stepper is not None and _fed(row)):
            break
        if row["samples_per_s"] >= best["samples_per_s"] * GAIN:
            best = row
        elif workers >= 2:  # 1 worker only moves the work off the main process: always try 2
            break  # more workers stopped helping
    top = _choose(trials, stepper is not None, memory_budget)
    if top["path"] == "workers" and top["num_workers"] > 0:
        for prefetch in (1, 4):
            if time.monotonic() > deadline:
                break
            trial(top["num_workers"], prefetch)
    # Every setting measured again, in reverse order, best of the two kept: a burst of
    # background work (another job, a compile, a checkpoint) during one trial cannot decide
    # the choice alone, as it does in a sweep measured once.
    for row in reversed(list(trials)):
        if time.monotonic() > deadline:
            break
        _merge(
            row,
            _trial(
                dataset,
                batch_size,
                collate_fn,
                row["num_workers"],
                row["prefetch_factor"],
                stepper,
                seconds_per_trial,
                row["path"],
            ),
        )
    if stepper is not None and time.monotonic() <= deadline:
        alone[0] = max(alone[0], _step_alone(stepper, sample[0], seconds_per_trial / 2))
    _kept(trials, alone[0])
    sample.clear()
    chosen = _choose(trials, stepper is not None, memory_budget)
    once = sum(row.get("runs", 1) < 2 for row in trials)
    reason = _reason(chosen, stepper is not None, memory_budget)
    if once:  # max_seconds ran out before the second round reached them
        reason += f" ({once} of {len(trials)} settings measured once: max_seconds ran out)"
    result = TuneResult(_settings(chosen, batch_size, bool(paths)), trials, reason, chosen)
    result.step = (
        f"the step {getattr(step, '__name__', type(step).__name__)}()"
        if step is not None
        else f"a simulated step of {step_seconds * 1000:g} ms"
        if step_seconds > 0
        else None
    )
    if _over(chosen, memory_budget):
        warnings.warn(
            f"autotune: no setting fits the memory budget of {memory_budget / 2**20:,.0f} MiB; the "
            f"one with the lowest peak ({chosen['peak_bytes'] / 2**20:,.0f} MiB) is returned and "
            "not stored.",
            LoaderWarning,
            stacklevel=2,
        )
    elif store and cut and chosen["path"] == "workers":
        warnings.warn(
            "autotune: max_seconds allowed one trial (0 workers) only; the result is not stored, "
            "so make_loader keeps its own sizing. Give it more time.",
            LoaderWarning,
            stacklevel=2,
        )
    elif store:
        save_tuned(dataset, result, chosen)
    return result


def _trial(
    dataset,
    batch_size,
    collate_fn,
    workers,
    prefetch,
    stepper,
    seconds,
    path="workers",
    sample: list | None = None,
) -> dict[str, Any]:
    """One setting measured beside `stepper`; its first batch goes to `sample` when that is
    empty."""
    from recipes.common.loading.loader import make_loader

    kwargs: dict[str, Any] = (
        {"num_workers": workers, "tuned": False}
        if path == "workers"
        else {"path": path, "tuned": False}
    )
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if workers:
        kwargs.update(prefetch_factor=prefetch, persistent_workers=False)
    if not isinstance(dataset, IterableDataset):
        kwargs["sampler"] = _Endless(len(dataset))
    loader = make_loader(dataset, profile="production", batch_size=batch_size, **kwargs)
    with PeakMemory(interval=0.25) as memory:
        batches = _endless_batches(loader)
        first = next(batches)  # start-up (worker spawn, first decode) is not steady state
        if sample is not None and not sample:
            sample.append(first)
        del first
        samples = 0
        wait = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            asked = time.perf_counter()
            batch = next(batches)
            wait += time.perf_counter() - asked
            samples += items_in(batch)
            if stepper is not None:
                stepper(batch)
        elapsed = time.perf_counter() - start
        batches.close()
        close = getattr(loader, "close", None)
        if (
            close is not None
        ):  # the isolated path's child, the thread pool: gone before the next trial
            close()
        del loader
    return {
        "path": path,
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "samples_per_s": samples / elapsed,
        "wait_fraction": wait / elapsed if stepper is not None else None,
        "peak_bytes": memory.peak,
    }


def _step_alone(stepper, batch, seconds: float) -> float:
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


def _kept(trials: list[dict[str, Any]], alone: float) -> None:
    """Each trial's rate as a share of the step's alone (`kept`), None without a step."""
    for row in trials:
        row["kept"] = min(1.0, row["samples_per_s"] / alone) if alone > 0 else None


def _merge(row: dict[str, Any], again: dict[str, Any]) -> None:
    """`again` folded into `row`: the faster run's rate and wait, the higher peak (memory is a
    limit)."""
    if again["samples_per_s"] > row["samples_per_s"]:
        row.update(samples_per_s=again["samples_per_s"], wait_fraction=again["wait_fraction"])
    row["peak_bytes"] = max(row["peak_bytes"], again["peak_bytes"])
    row["runs"] = row.get("runs", 1) + 1


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


def _worker_counts(limit: int) -> list[int]:
    """The worker counts the sweep tries after 0 (none when `limit` is 0)."""
    counts = [c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if c <= limit]
    return counts if not limit or counts[-1] == limit else [*counts, limit]


def _fed(row: dict[str, Any]) -> bool:
    """The loop waits under 10% of its time for data, and keeps 90% of its step's rate alone
    or more (no step: never fed)."""
    kept = row.get("kept")
    return (
        row["wait_fraction"] is not None
        and row["wait_fraction"] < WAIT_TARGET
        and (kept is None or kept >= 1 - WAIT_TARGET)
    )


def _over(row: dict[str, Any], budget: int | None) -> bool:
    return budget is not None and row["peak_bytes"] > budget


def _cost(row: dict[str, Any]) -> tuple[int, int, int]:
    """Processes first (the main process only: 0 workers, then its threads; one child: the
    isolated threads, then 1 worker), then batches in flight."""
    if row["path"] == "threads":
        return 0, 1, 0
    if row["path"] == "isolated":
        return 1, 0, 0
    return row["num_workers"], int(row["num_workers"] > 0), row["prefetch_factor"] or 0


def _key(row: dict[str, Any]) -> tuple[str, int, int | None]:
    return row["path"], row["num_workers"], row["prefetch_factor"]


def _label(row: dict[str, Any]) -> str:
    if row["path"] == "threads":
        return "threads of this process (path='threads')"
    if row["path"] == "isolated":
        return "threads of one child process (path='isolated')"
    return f"workers={row['num_workers']} prefetch={row['prefetch_factor'] or '-'}"


def _thread_paths(dataset) -> list[str]:
    """The thread paths `dataset` can take now, in the order tried."""
    from recipes.common.loading.loader_path import isolated_available, thread_capable

    if not thread_capable(dataset):
        return []
    return ["threads", "isolated"] if isolated_available() else ["threads"]


def _choose(trials: list[dict[str, Any]], with_step: bool, budget: int | None) -> dict[str, Any]:
    fitting = [t for t in trials if not _over(t, budget)] or [
        min(trials, key=lambda t: t["peak_bytes"])
    ]
    if with_step:
        fed = [t for t in fitting if _fed(t)]
        if fed:
            return min(fed, key=_cost)
    fastest = max(t["samples_per_s"] for t in fitting)
    return min((t for t in fitting if t["samples_per_s"] * GAIN >= fastest), key=_cost)


def _settings(row: dict[str, Any], batch_size: int, with_path: bool) -> dict[str, Any]:
    if row["path"] != "workers":
        return {"batch_size": batch_size, "path": row["path"]}
    settings: dict[str, Any] = {"batch_size": batch_size, "num_workers": row["num_workers"]}
    if (
        with_path
    ):  # the dataset could take threads: make_loader's "auto" is told it measured workers
        settings["path"] = "workers"
    if row["num_workers"]:
        settings.update(prefetch_factor=row["prefetch_factor"], persistent_workers=True)
    return settings


def _reason(row: dict[str, Any], with_step: bool, budget: int | None) -> str:
    rate = f"{row['samples_per_s']:,.1f} samples/s"
    if with_step and _fed(row):
        kept = (
            "" if row.get("kept") is None else f", the step at {row['kept']:.0%} of its rate alone"
        )
        why = (
            f"the cheapest setting whose data wait is under {WAIT_TARGET:.0%} "
            f"({row['wait_fraction']:.1%}{kept}), {rate}"
        )
    else:
        why = f"the cheapest setting within {GAIN - 1:.0%} of the fastest rate, {rate}"
    if budget is not None and _over(row, budget):
        why += (
            f"; no setting fits the memory budget of {budget / 2**20:,.0f} MiB: the lowest peak, "
            f"{row['peak_bytes'] / 2**20:,.0f} MiB"
        )
    elif budget is not None:
        why += f", within the memory budget of {budget / 2**20:,.0f} MiB"
    return f"autotune: {_label(row)}, {why}"


def _sleeper(seconds: float) -> Callable[[Any], None]:
    def step(_batch) -> None:
        time.sleep(seconds)

    return step


def _check(
    batch_size, step_seconds, seconds_per_trial, max_seconds, memory_budget, max_workers
) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, but is {batch_size!r} instead.")
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 0):
        raise ValueError(
            f"`max_workers` must be a non-negative integer, but is {max_workers!r} instead."
        )
    if step_seconds < 0:
        raise ValueError(f"`step_seconds` must be non-negative, but is {step_seconds!r} instead.")
    for name, value in (("seconds_per_trial", seconds_per_trial), ("max_seconds", max_seconds)):
        if not 0 < value < float("inf"):
            raise ValueError(f"`{name}` must be positive and finite, but is {value!r} instead.")
    if memory_budget is not None and memory_budget <= 0:
        raise ValueError(f"`memory_budget` must be positive, but is {memory_budget!r} instead.")
