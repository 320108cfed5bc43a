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
the main process and its workers during each trial. Adapt here: `_worker_counts`, and in
`tune_choice.py` `GAIN` (what counts as "helping") and `WAIT_TARGET`. Trade-off: trials are short,
so figures carry ~5-10% noise (the second round keeps one burst of background work from
deciding); a dataset whose cost changes over an epoch (cache warming) is tuned as it is now.
Results are stored per dataset, batch size and machine, and `make_loader` reuses them.
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
  common/tuning/tune_choice.py, common/tuning/tune_trial.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from recipes.common.loader_warning import LoaderWarning
from recipes.common.loading.loader_path import isolated_available, thread_capable
from recipes.common.sizing.resources import detect_resources
from recipes.common.sizing.sizing import local_world_size_from_env
from recipes.common.sizing.tune_store import save_tuned
from recipes.common.tuning.tune_choice import (
    GAIN,
    WAIT_TARGET,  # noqa: F401 (re-exported)
    choice_reason,
    choose_trial,
    is_fed,
    loader_settings,
    over_budget,
    setting_key,
    setting_label,
)
from recipes.common.tuning.tune_trial import (
    TrialSetup,
    measure_step_alone,
    merge_rerun,
    run_trial,
    set_kept,
    sleeper,
)


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
        # what the trials ran beside, in words (stored with the result)
        self.step: str | None = None

    def table(self) -> str:
        lines = [
            "| path | workers | prefetch | samples/s | data wait | of the step alone | peak "
            "memory (MiB) | chosen |",
            "|:---|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for t in self.trials:
            lines.append(self._table_row(t))
        return "\n".join(lines) + f"\n\n{self.reason}"

    def _table_row(self, t: dict[str, Any]) -> str:
        mark = ""
        if self.chosen is not None and setting_key(t) == setting_key(self.chosen):
            mark = "yes"
        workers = "-"
        if t["path"] == "workers":
            workers = t["num_workers"]
        return (
            f"| {t['path']} | {workers} | {t['prefetch_factor'] or '-'} | "
            f"{t['samples_per_s']:,.1f} | {_percent(t['wait_fraction'])} | "
            f"{_percent(t.get('kept'))} | {t['peak_bytes'] / 2**20:,.0f} | {mark} |"
        )


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
    limit = max_workers
    if limit is None:
        limit = max(1, detect_resources().cpus // local_world_size_from_env())
    setup = TrialSetup(
        dataset, batch_size, collate_fn, _stepper(step, step_seconds), seconds_per_trial
    )
    with_step = setup.stepper is not None
    sweep = _Sweep(setup, deadline=time.monotonic() + max_seconds, log=log)
    paths = _thread_paths(dataset)
    cut = sweep.sweep_workers(paths, limit, memory_budget)
    sweep.sweep_prefetch(memory_budget)
    sweep.measure_again()
    trials = sweep.trials
    chosen = choose_trial(trials, with_step, memory_budget)
    once = sum(row.get("runs", 1) < 2 for row in trials)
    reason = choice_reason(chosen, with_step, memory_budget)
    if once:  # max_seconds ran out before the second round reached them
        reason += f" ({once} of {len(trials)} settings measured once: max_seconds ran out)"
    settings = loader_settings(chosen, batch_size, bool(paths))
    result = TuneResult(settings, trials, reason, chosen)
    result.step = _step_words(step, step_seconds)
    _store(dataset, result, store=store, cut=cut, budget=memory_budget)
    return result


class _Sweep:
    """One `autotune` run: its trials in the order measured, the first batch (the step alone
    is measured on it), the step's rate alone, and the deadline."""

    def __init__(self, setup: TrialSetup, *, deadline: float, log: Callable[[str], None] | None):
        self.setup = setup
        self.deadline = deadline
        self.log = log
        self.trials: list[dict[str, Any]] = []
        self.sample: list = []  # the first batch of the first trial
        self.alone = (
            0.0  # the step's own rate (samples/s) without a loader, the best of its measures
        )

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def trial(self, workers: int, prefetch: int | None, path: str = "workers") -> dict[str, Any]:
        row = run_trial(self.setup, workers, prefetch, path, self.sample)
        self.trials.append(row)
        stepper = self.setup.stepper
        if stepper is not None and not self.alone:
            self.alone = measure_step_alone(stepper, self.sample[0], self.setup.seconds / 2)
        set_kept(self.trials, self.alone)
        if self.log is not None:
            wait = row["wait_fraction"]
            if wait is not None:
                wait = round(wait, 3)
            self.log(
                f"{setting_label(row)}: {row['samples_per_s']:,.1f} samples/s, wait {wait}, "
                f"peak {row['peak_bytes'] / 2**20:,.0f} MiB"
            )
        return row

    def sweep_workers(self, paths: list[str], limit: int, budget: int | None) -> bool:
        """The thread paths, 0 workers, then more workers while they help. Returns whether the
        deadline stopped the sweep before it tried one worker count."""
        with_step = self.setup.stepper is not None
        for (
            name
        ) in paths:  # fed beside the step, one leaves the workers only 0 of them to be cheaper
            self.trial(0, None, name)
        best = self.trial(0, None)
        for workers in _worker_counts(limit):
            if with_step and any(is_fed(t) for t in self.trials):
                break  # fed already: more workers cost more
            if self.out_of_time():
                return len(self.trials) == 1 + len(paths)
            row = self.trial(workers, 2)
            if over_budget(row, budget) or (with_step and is_fed(row)):
                break
            if row["samples_per_s"] >= best["samples_per_s"] * GAIN:
                best = row
            elif workers >= 2:  # 1 worker only moves the work off the main process: always try 2
                break  # more workers stopped helping
        return False

    def sweep_prefetch(self, budget: int | None) -> None:
        """Prefetch factors 1 and 4 at the best worker count so far."""
        top = choose_trial(self.trials, self.setup.stepper is not None, budget)
        if top["path"] != "workers" or top["num_workers"] == 0:
            return
        for prefetch in (1, 4):
            if self.out_of_time():
                break
            self.trial(top["num_workers"], prefetch)

    def measure_again(self) -> None:
        """Every setting measured again, in reverse order, best of the two kept: a burst of
        background work (another job, a compile, a checkpoint) during one trial cannot decide
        the choice alone, as it does in a sweep measured once."""
        for row in reversed(list(self.trials)):
            if self.out_of_time():
                break
            again = run_trial(self.setup, row["num_workers"], row["prefetch_factor"], row["path"])
            merge_rerun(row, again)
        stepper = self.setup.stepper
        if stepper is not None and not self.out_of_time():
            alone = measure_step_alone(stepper, self.sample[0], self.setup.seconds / 2)
            self.alone = max(self.alone, alone)
        set_kept(self.trials, self.alone)
        self.sample.clear()


def _store(dataset, result: TuneResult, *, store: bool, cut: bool, budget: int | None) -> None:
    """Saves the result for `make_loader`, unless it breaks the memory budget or the deadline
    allowed 0 workers only (both warn)."""
    chosen = result.chosen
    if over_budget(chosen, budget):
        warnings.warn(
            f"autotune: no setting fits the memory budget of {budget / 2**20:,.0f} MiB; the "
            f"one with the lowest peak ({chosen['peak_bytes'] / 2**20:,.0f} MiB) is returned and "
            "not stored.",
            LoaderWarning,
            stacklevel=3,
        )
    elif store and cut and chosen["path"] == "workers":
        warnings.warn(
            "autotune: max_seconds allowed one trial (0 workers) only; the result is not stored, "
            "so make_loader keeps its own sizing. Give it more time.",
            LoaderWarning,
            stacklevel=3,
        )
    elif store:
        save_tuned(dataset, result, chosen)


def _stepper(step, step_seconds: float) -> Callable[[Any], Any] | None:
    """What each trial calls per batch: the real step, else a sleep of `step_seconds`."""
    if step is not None:
        return step
    if step_seconds > 0:
        return sleeper(step_seconds)
    return None


def _step_words(step, step_seconds: float) -> str | None:
    """What the trials ran beside, in words."""
    if step is not None:
        return f"the step {getattr(step, '__name__', type(step).__name__)}()"
    if step_seconds > 0:
        return f"a simulated step of {step_seconds * 1000:g} ms"
    return None


def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}"


def _worker_counts(limit: int) -> list[int]:
    """The worker counts the sweep tries after 0 (none when `limit` is 0)."""
    counts = [c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if c <= limit]
    if limit and counts[-1] != limit:
        counts.append(limit)
    return counts


def _thread_paths(dataset) -> list[str]:
    """The thread paths `dataset` can take now, in the order tried."""
    if not thread_capable(dataset):
        return []
    if isolated_available():
        return ["threads", "isolated"]
    return ["threads"]


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
