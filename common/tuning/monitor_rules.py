"""The warnings `LoaderMonitor` gives at the end of an epoch: an ordered table of rules.

Use when: you want to know why the monitor warned, or to change what it warns about. Each rule
reads one epoch's row (`LoaderMonitor.epochs`) and the monitor's thresholds, and returns its
warnings (none when the epoch is healthy), each as what was seen and its likely cause and fix.
Cost: a few comparisons per epoch.
Adapt here: `RULES` (add, drop or reorder a rule), `EXIT_CAUSES`; the thresholds are the
monitor's `warn_*` arguments.
Trade-off: a rule names the likely cause, not a proven one: a starved step may have a slow disk
as well as too few workers. `profile_trace` shows the exact timeline.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class EpochWarning(NamedTuple):
    """One warning an epoch earned."""

    seen: str  # what the epoch's figures show, against the threshold
    cause_and_fix: str  # the likely cause and what to do, in sentences

    def text(self, epoch: int) -> str:
        return f"epoch {epoch}: {self.seen} {self.cause_and_fix}"


# The monitor's thresholds are its public `warn_*` attributes; a rule reads them and `loader`.
Rule = Callable[[dict[str, Any], Any], list[EpochWarning]]

_WORKERS_STARVED = (
    "Likely cause: too few workers for the decode cost, or slow storage. Fix: "
    "`recipes tune` / autotune() for num_workers and prefetch_factor, a decoded cache "
    "(build_image_cache, build_token_cache), or PrefetchCache for remote data."
)


def step_starved(row: dict[str, Any], monitor) -> list[EpochWarning]:
    """The loop waited for data longer than `warn_wait_fraction` of the steady-state time: the
    accelerator idles, whatever else is healthy."""
    if row["batches"] <= 1 or not row["wait_fraction"] > monitor.warn_wait_fraction:
        return []
    fix = _WORKERS_STARVED
    threads = getattr(monitor.loader, "read_ahead_threads", None)
    if threads is not None:
        fix = (
            f"Likely cause: the {threads} thread(s) of the thread path (ThreadLoader) cannot make "
            "batches as fast as the step uses them, or their work holds the GIL. Fix: a decoded "
            "cache (build_image_cache, build_token_cache) if there is none, more CPUs for this "
            "rank, or make_loader(..., path='workers') with `recipes tune` for work that is "
            "Python per item."
        )
    seen = (
        f"the loop waited for data {row['wait_fraction']:.0%} of the time "
        f"(threshold {monitor.warn_wait_fraction:.0%}); the step is starved."
    )
    return [EpochWarning(seen, fix)]


def slow_batch(row: dict[str, Any], monitor) -> list[EpochWarning]:
    """A batch after the epoch's first took longer than `warn_batch_seconds`: one slow read or
    worker stalls the whole step, even when the mean wait is low."""
    if not row["max_batch_s"] > monitor.warn_batch_seconds or row["batches"] <= 1:
        return []
    seen = (
        f"a batch took {row['max_batch_s']:.2f} s to arrive (threshold "
        f"{monitor.warn_batch_seconds:.2f} s; batch-time CV {row['batch_time_cv']:.2f})."
    )
    fix = (
        "Likely cause: a slow read (remote storage, a huge or corrupt file) or a straggling "
        "worker. Fix: PrefetchCache for remote shards, a higher prefetch_factor "
        "(ThreadLoader: `prefetch`) to absorb jitter, or check the files the slow indices map "
        "to."
    )
    return [EpochWarning(seen, fix)]


def slow_first_batch(row: dict[str, Any], monitor) -> list[EpochWarning]:
    """The epoch's first batch took longer than `warn_first_batch_seconds`: start-up paid
    every epoch adds up over a run."""
    if not row["first_batch_s"] > monitor.warn_first_batch_seconds:
        return []
    seen = (
        f"the first batch took {row['first_batch_s']:.1f} s (threshold "
        f"{monitor.warn_first_batch_seconds:.1f} s)."
    )
    fix = (
        "Likely cause: workers started with spawn or forkserver re-import torch, or a heavy "
        "dataset constructor. Fix: the fork start method (make_loader's default) and "
        "persistent_workers=True."
    )
    return [EpochWarning(seen, fix)]


def memory_grew(row: dict[str, Any], monitor) -> list[EpochWarning]:
    """Main or worker memory grew more than `warn_memory_growth` since the last epoch (from
    the second on): a leak or copy-on-read ends in the out-of-memory killer."""
    growth = row["memory_growth"]
    if growth is None or not growth > monitor.warn_memory_growth:
        return []
    seen = (
        f"loader memory grew {growth:.0%} since the last epoch (threshold "
        f"{monitor.warn_memory_growth:.0%})."
    )
    fix = (
        "Likely cause: forked workers touching Python lists or dicts of the index "
        "(copy-on-read), or a per-worker cache without a bound. Fix: keep the index in numpy "
        "arrays or PackedStrings, bound caches."
    )
    return [EpochWarning(seen, fix)]


EXIT_CAUSES = {
    -9: "killed by SIGKILL, usually the out-of-memory killer",
    -7: "a bus error, usually a full /dev/shm",
}


def worker_died(row: dict[str, Any], monitor) -> list[EpochWarning]:
    """A DataLoader worker exited with an error: one warning per death, with the cause its
    exit code names (`EXIT_CAUSES`)."""
    out = []
    for code in row["worker_exit_codes"]:
        cause = EXIT_CAUSES.get(code, f"exit code {code}")
        fix = (
            "Fix: fewer workers, prefetch_factor=1, profile='memory', or a larger /dev/shm "
            "(docker --shm-size)."
        )
        out.append(EpochWarning(f"a DataLoader worker died ({cause}).", fix))
    return out


RULES: tuple[Rule, ...] = (step_starved, slow_batch, slow_first_batch, memory_grew, worker_died)


def diagnose(row: dict[str, Any], monitor) -> list[str]:
    """The warnings the monitor's latest epoch (`row`) earns, in the order of `RULES`."""
    epoch = len(monitor.epochs) - 1
    return [warning.text(epoch) for rule in RULES for warning in rule(row, monitor)]
