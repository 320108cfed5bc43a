"""One epoch's figures as `LoaderMonitor` gathers them: waits, step times, memory peaks, worker
deaths, and the share of each source the loop received (in samples, and in tokens for a
mixture with `lengths`) beside the mixture's target at the epoch's end.

Use when: you read `LoaderMonitor.epochs` and want to know how a figure is computed (the
steady-state wait leaves each epoch's first batch out; memory growth counts only growth of at
least `MIN_GROWTH_BYTES`).
Cost: a few list appends per batch; the row is computed once, at the epoch's end (a mixture's
shares: one pass over this rank's indices and over the epoch's plan).
Adapt here: `EpochFigures.row` (the figures of a row), `MIN_GROWTH_BYTES`.
Trade-off: the batch waits are kept in full for the epoch (8 bytes a batch), so the coefficient
of variation is exact; a bounded summary would not be.
Copy with: nothing.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

MIN_GROWTH_BYTES = 16 * 2**20


class EpochFigures:
    """Running figures of one epoch."""

    def __init__(self, index: int):
        self.index = index
        self.batches = 0
        self.samples = 0
        self.wait_s = 0.0
        self.step_s = 0.0
        self.waits: list[float] = []
        self.first_batch_s = 0.0
        self.first_items = 0
        self.last_sample = 0.0
        self.main_rss = 0
        self.workers_uss = 0
        self.workers_pss = 0
        self.workers = 0
        self.deaths: list[tuple[int, int]] = []
        self.per_worker: dict[int, tuple[int, int]] = {}
        self.shm_used: int | None = None
        self.gpu_util: list[float] = []
        self.gpu_memory: int | None = None
        self.seconds = 0.0
        self.net_bytes: int | None = None

    def add(self, wait: float, step: float, items: int) -> None:
        self.batches += 1
        self.samples += items
        self.wait_s += wait
        self.step_s += step
        self.waits.append(wait)

    def row(self, prefetch: dict | None) -> dict[str, Any]:
        steady = self.waits[1:]
        steady_wait = sum(steady)
        steady_s = max(0.0, self.seconds - self.first_batch_s)
        mean = ratio(sum(steady), len(steady))
        var = ratio(sum((w - mean) ** 2 for w in steady), len(steady))
        gpu_util = None
        if self.gpu_util:
            gpu_util = sum(self.gpu_util) / len(self.gpu_util)
        return {
            "batches": self.batches,
            "samples": self.samples,
            "seconds": self.seconds,
            "samples_per_s": ratio(self.samples, self.seconds),
            "steady_samples_per_s": ratio(self.samples - self.first_items, steady_s),
            "wait_s": self.wait_s,
            "step_s": self.step_s,
            "steady_wait_s": steady_wait,
            "steady_s": steady_s,
            "wait_fraction": ratio(steady_wait, steady_s),
            "wait_fraction_with_start": ratio(self.wait_s, self.wait_s + self.step_s),
            "first_batch_s": self.first_batch_s,
            # the first batch counts only when it is the epoch's one batch
            "max_batch_s": max(steady or self.waits[:1] or [0.0]),
            "batch_time_cv": ratio(math.sqrt(var), mean),
            "main_rss_bytes": self.main_rss,
            "workers": self.workers,
            "workers_uss_bytes": self.workers_uss or None,
            "workers_pss_bytes": self.workers_pss or None,
            "per_worker": [
                {"pid": pid, "uss_bytes": uss, "pss_bytes": pss}
                for pid, (uss, pss) in sorted(self.per_worker.items())
            ],
            "worker_deaths": len(self.deaths),
            "worker_exit_codes": [code for _, code in self.deaths],
            "shm_used_bytes": self.shm_used,
            "gpu_util": gpu_util,
            "gpu_memory_bytes": self.gpu_memory,
            "net_bytes_recv": self.net_bytes,
            "prefetch": prefetch,
        }


def memory_growth(previous: dict | None, row: dict) -> float | None:
    """The larger relative growth of main RSS and workers' USS since `previous`, counting only
    growth of at least `MIN_GROWTH_BYTES` (a few MiB of a young worker are not a leak)."""
    if previous is None:
        return None
    growths = [0.0]
    for key in ("main_rss_bytes", "workers_uss_bytes"):
        before = previous.get(key)
        now = row.get(key)
        if before and now and now - before >= MIN_GROWTH_BYTES:
            growths.append(now / before - 1.0)
    return max(growths)


class RealisedMixture(NamedTuple):
    """What a rank's loop received from a `MixtureSampler` in an epoch, by source name."""

    samples: dict[str, float]
    """Each source's share of the samples received (the row's `sources`)."""
    tokens: dict[str, float] | None
    """Each source's share of their tokens (`sources_tokens`); None without `lengths`, and for a
    pass an index-mode sampler resumed by itself (its indices are not known here)."""
    target: dict[str, float] | None
    """The weights in force at the epoch's end (`sources_target`)."""


def realised_mixture(loader, samples: int) -> RealisedMixture | None:
    """The share of each source among the `samples` samples this rank's loop received in the
    epoch (after the batches a resume skipped), in samples and, when the mixture has `lengths`,
    in tokens, and the target at the epoch's end, from the loader's `MixtureSampler` (its
    sampler or batch sampler, or a bucketing sampler's `mixture`); None without one."""
    found = _received(loader, samples)
    if found is None:
        return None
    mixture, counts, indices = found
    total = sum(counts.values())
    if not total:
        return None
    shares = {name: count / total for name, count in counts.items()}
    tokens = None
    lengths = getattr(mixture, "lengths", None)
    if lengths is not None and indices is not None and len(indices):
        per_source = np.bincount(
            mixture.source_of(indices), weights=lengths[indices], minlength=len(mixture.names)
        )
        tokens = {
            name: float(t / per_source.sum())
            for name, t in zip(mixture.names, per_source, strict=True)
        }
    return RealisedMixture(shares, tokens, _target_at_end(mixture))


def _received(loader, samples: int):
    """(mixture, samples per source, the indices received or None) of the loader's mixture."""
    inner = getattr(loader, "loader", loader)
    skipped = getattr(inner, "skipped_batches", None)
    skip = 0  # batches of the epoch a resume skipped
    if skipped is not None:
        skip = int(skipped() or 0)
    batch_sampler = getattr(inner, "batch_sampler", None)
    for candidate in (
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(inner, "sampler", None),
    ):
        if hasattr(candidate, "source_counts"):
            if getattr(candidate, "batch_size", None) is not None and candidate is batch_sampler:
                # it resumes by itself: this pass's batches begin at its global position
                return _batches_received(candidate, candidate.pass_batches()[skip:], samples)
            batch_size = int(getattr(inner, "batch_size", None) or 1)
            counts = candidate.source_counts(samples, start=skip * batch_size)
            indices = _plan_received(candidate, skip * batch_size, samples)
            return candidate, counts, indices
        mixture = getattr(candidate, "mixture", None)
        if hasattr(mixture, "source_of") and hasattr(candidate, "pass_batches"):
            # mixed, then bucketed: a bucketing sampler resumes by itself too
            return _batches_received(mixture, candidate.pass_batches()[skip:], samples)
    return None


def _batches_received(mixture, batches: list, samples: int):
    """(mixture, samples per source, indices) among the first `samples` indices of `batches`."""
    mine = np.asarray([int(i) for batch in batches for i in batch][:samples], np.int64)
    found = np.bincount(mixture.source_of(mine), minlength=len(mixture.names))
    counts = {name: int(c) for name, c in zip(mixture.names, found, strict=True)}
    return mixture, counts, mine


def _plan_received(mixture, start: int, samples: int):
    """This rank's samples `start:start + samples` of the epoch's plan (index mode: padded to a
    multiple of the ranks, dealt r, r + R, ...), or None for a pass the sampler resumed by
    itself (it began past the plan's known start: its pass on this rank is shorter)."""
    plan = mixture.global_indices()
    ranks = mixture.num_replicas
    if len(plan) % ranks and len(plan):
        plan = np.concatenate([plan, plan[np.arange(ranks - len(plan) % ranks) % len(plan)]])
    part = plan[mixture.rank :: ranks]
    if sum(mixture.source_counts().values()) != len(part):
        return None
    return part[start : start + samples]


def _target_at_end(mixture) -> dict[str, float] | None:
    """The weights in force at the epoch's last unit (`MixtureSampler.share_trace`)."""
    if not hasattr(mixture, "share_trace"):
        return None
    trace = mixture.share_trace(window=1, points=1)
    if not len(trace.progress):
        return None
    return {name: float(w) for name, w in zip(trace.names, trace.target[-1], strict=True)}


def ratio(part: float, whole: float) -> float:
    """`part / whole`, 0.0 when `whole` is not positive."""
    if whole > 0:
        return part / whole
    return 0.0
