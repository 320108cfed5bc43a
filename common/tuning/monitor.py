"""LoaderMonitor: is the training loop waiting for data, and is the loader healthy?

Use when: always, in production training. Iterate the monitor in place of the loader; it times
every `next(loader)` against the time your step takes, and once per epoch reads the memory of
the main process and of each worker, worker deaths, `/dev/shm`, the GPU (NVML), network
bytes and `PrefetchCache` counters. Past a threshold it warns (`LoaderWarning`) with the
likely cause and the fix. `plot()` draws the run's timeline (step by step: wait, compute, memory).
Cost: two `perf_counter` calls and a bounded timeline's few numpy writes per batch; a resource
reading (a few ms per process: smaps) at the first batch, then at most every `sample_seconds`.
Adapt here: the thresholds (the defaults are the production rules: a batch over 1 s, memory
growth over 20% between epochs, data wait over 20%), `items_in` for your batch type.
Trade-off: step time is what the CPU sees. CUDA runs asynchronously, so a loop that never
synchronises (no `loss.item()`, no logging) shows step time in the next `next()` instead;
`profile_trace` shows the exact timeline.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py, common/loader_warning.py,
  common/remote/cache_download.py, common/remote/object_download.py, common/remote/object_urls.py,
  common/remote/prefetch_cache.py, common/remote/process_downloads.py,
  common/remote/ranged_download.py, common/remote/retries.py, common/tuning/monitor_plot.py,
  common/tuning/probes.py, common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from typing import Any

import numpy as np

from recipes.common.loader_warning import LoaderWarning
from recipes.common.tuning.monitor_plot import StepTimeline, plot_timeline
from recipes.common.tuning.probes import gpu_reading, prefetch_caches, process_memory


class LoaderMonitor:
    """Iterates `loader`, measuring the data wait and the loader's resources.

    Args:
        loader: a DataLoader (or any iterable of batches).
        warn_batch_seconds: warn when a batch (after an epoch's first) takes longer to arrive.
        warn_memory_growth: warn when main or worker memory grows more than this fraction
            (and at least 16 MiB) from one epoch to the next, from the second epoch on (the
            first is the workers' warm-up).
        warn_wait_fraction: warn when the loop waits for data more than this fraction of the
            steady-state epoch time.
        sample_seconds: the least time between resource readings within an epoch.
        warn_first_batch_seconds: warn when an epoch's first batch (worker start-up) is slower.

    Example:
        >>> monitor = LoaderMonitor(make_loader(dataset, shuffle=True))
        >>> for epoch in range(epochs):
        ...     for images, targets in monitor:
        ...         step(images, targets)
        ...     print(monitor.report())
        >>> monitor.plot("timeline.png")  # or .svg; matplotlib: pip install "loader-recipes[plot]"
    """

    def __init__(
        self,
        loader,
        *,
        warn_batch_seconds: float = 1.0,
        warn_memory_growth: float = 0.20,
        warn_wait_fraction: float = 0.20,
        sample_seconds: float = 5.0,
        warn_first_batch_seconds: float = 10.0,
    ):
        for name, value in (
            ("warn_batch_seconds", warn_batch_seconds),
            ("warn_memory_growth", warn_memory_growth),
            ("warn_wait_fraction", warn_wait_fraction),
            ("sample_seconds", sample_seconds),
        ):
            if not value > 0:
                raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
        self.loader = loader
        self.warn_batch_seconds = warn_batch_seconds
        self.warn_memory_growth = warn_memory_growth
        self.warn_wait_fraction = warn_wait_fraction
        self.sample_seconds = sample_seconds
        self.warn_first_batch_seconds = warn_first_batch_seconds
        self.epochs: list[dict[str, Any]] = []
        self.timeline = StepTimeline()  # per step: data wait and compute, bounded (monitor_plot.py)
        self._known_workers: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):  # dataset, batch_sampler, sampler, recipe, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        epoch = _Epoch(len(self.epochs))
        net_before = _net_bytes()
        caches_before = {id(c): c.stats() for c in prefetch_caches(self.loader)}
        iterator = iter(self.loader)
        begin = time.perf_counter()
        handed_back = begin  # when the latest batch was handed to the loop
        try:
            while True:
                asked = time.perf_counter()
                self.timeline.close(asked - handed_back)
                try:
                    batch = next(iterator)
                except StopIteration:
                    epoch.step_s += asked - handed_back if epoch.batches else 0.0
                    break
                except RuntimeError:
                    self._sample(
                        epoch, iterator
                    )  # record the deaths behind "worker exited unexpectedly"
                    raise
                got = time.perf_counter()
                self.timeline.open(asked, got, epoch.index)
                epoch.add(got - asked, asked - handed_back, items_in(batch))
                if epoch.batches == 1 or got - epoch.last_sample >= self.sample_seconds:
                    epoch.last_sample = got
                    self._sample(epoch, iterator)
                    if epoch.batches == 1:
                        epoch.first_batch_s = got - begin
                        epoch.first_items = epoch.samples
                handed_back = time.perf_counter()  # the step runs from here to the next ask
                yield batch
        finally:  # also when the loop breaks out early (GeneratorExit) or a worker dies
            self.timeline.end()
            self._close(epoch, begin, net_before, caches_before)

    # ---- readings --------------------------------------------------------------------------
    def _sample(self, epoch: _Epoch, iterator) -> None:
        for process in getattr(iterator, "_workers", None) or []:
            if process.pid is not None:
                self._known_workers[process.pid] = process
        main, workers = process_memory(list(self._known_workers))
        epoch.main_rss = max(epoch.main_rss, main)
        alive = {pid: mem for pid, mem in workers.items() if mem is not None}
        self.timeline.read_memory(main, sum(m[0] for m in alive.values()))
        for pid, (uss, pss) in alive.items():
            peak = epoch.per_worker.get(pid, (0, 0))
            epoch.per_worker[pid] = (max(peak[0], uss), max(peak[1], pss))
        if alive:
            epoch.workers_uss = max(epoch.workers_uss, sum(m[0] for m in alive.values()))
            epoch.workers_pss = max(epoch.workers_pss, sum(m[1] for m in alive.values()))
            epoch.workers = max(epoch.workers, len(alive))
        for pid, process in list(self._known_workers.items()):
            code = process.exitcode
            if code is not None:
                del self._known_workers[pid]
                if code != 0:
                    epoch.deaths.append((pid, code))
        with _quiet():
            shm = shutil.disk_usage("/dev/shm").used if os.path.isdir("/dev/shm") else None
        epoch.shm_used = max(epoch.shm_used or 0, shm) if shm is not None else epoch.shm_used
        gpu = gpu_reading()
        if gpu is not None:
            epoch.gpu_util.append(gpu[0])
            epoch.gpu_memory = max(epoch.gpu_memory or 0, gpu[1])

    def _close(
        self, epoch: _Epoch, begin: float, net_before: int | None, caches_before: dict
    ) -> None:
        epoch.seconds = time.perf_counter() - begin
        net = _net_bytes()
        epoch.net_bytes = None if net is None or net_before is None else net - net_before
        prefetch = {"hits": 0, "misses": 0, "bytes_downloaded": 0}
        for cache in prefetch_caches(self.loader):
            before = caches_before.get(id(cache), {})
            for key, value in cache.stats().items():
                prefetch[key] += value - before.get(key, 0)
        row = epoch.row(prefetch if caches_before else None)
        row["sources"] = _realised_mixture(self.loader, row["samples"])
        # The first epoch is the workers' warm-up (forked, then touching what they use): growth
        # is judged from the second epoch on.
        previous = self.epochs[-1] if len(self.epochs) >= 2 else None
        row["memory_growth"] = _growth(previous, row)
        self.epochs.append(row)
        for message in _diagnose(row, self):
            warnings.warn(message, LoaderWarning, stacklevel=3)

    # ---- results ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Totals over every epoch so far, with the latest epoch's resource readings.

        Keys: `epochs`, `batches`, `samples`, `seconds`, `samples_per_s`, `wait_fraction`
        (steady state: after each epoch's first batch), `wait_fraction_with_start` (whole
        epochs), `first_batch_s` (the latest epoch's), `max_batch_s`, `batch_time_cv`
        (coefficient of variation of the batch waits), `worker_deaths`, and the latest
        epoch's `main_rss_bytes`, `workers_uss_bytes`, `workers_pss_bytes` (peak sums),
        `per_worker` (peak USS/PSS by pid), `memory_growth`,
        `shm_used_bytes`, `gpu_util` (%, mean), `gpu_memory_bytes`, `net_bytes_recv`,
        `prefetch` (None where not measurable), `sources` (a `MixtureSampler`'s realised
        proportion of each source in the latest epoch's samples, by name; None without one).
        """
        if not self.epochs:
            return {
                "epochs": 0,
                "batches": 0,
                "samples": 0,
                "seconds": 0.0,
                "samples_per_s": 0.0,
                "wait_fraction": 0.0,
                "wait_fraction_with_start": 0.0,
                "max_batch_s": 0.0,
            }
        last = self.epochs[-1]
        total = {
            key: sum(e[key] for e in self.epochs)
            for key in (
                "batches",
                "samples",
                "seconds",
                "wait_s",
                "step_s",
                "steady_wait_s",
                "steady_s",
            )
        }
        out = {key: value for key, value in last.items() if key not in total}
        out.update(
            epochs=len(self.epochs),
            batches=total["batches"],
            samples=total["samples"],
            seconds=total["seconds"],
            samples_per_s=total["samples"] / total["seconds"] if total["seconds"] > 0 else 0.0,
            wait_fraction=_ratio(total["steady_wait_s"], total["steady_s"]),
            wait_fraction_with_start=_ratio(total["wait_s"], total["wait_s"] + total["step_s"]),
            max_batch_s=max(e["max_batch_s"] for e in self.epochs),
            worker_deaths=sum(e["worker_deaths"] for e in self.epochs),
        )
        return out

    def plot(self, path, *, x: str = "time", title: str | None = None):
        """Draws the timeline of every step so far to `path` (.png or .svg): data wait and compute
        per step, memory on a second axis (`recipes.common.tuning.monitor_plot.plot_timeline`)."""
        return plot_timeline(self.timeline, path, x=x, title=title)

    def report(self) -> str:
        """A Markdown table, one row per epoch."""
        lines = [
            "| epoch | samples/s | data wait | first batch (s) | max batch (s) | batch CV | main "
            "RSS (MiB) | workers USS (MiB) | growth | deaths | /dev/shm (MiB) | GPU util | net "
            "(MiB) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, e in enumerate(self.epochs):
            growth = "-" if e["memory_growth"] is None else f"{e['memory_growth']:+.0%}"
            gpu = "-" if e["gpu_util"] is None else f"{e['gpu_util']:.0f}%"
            lines.append(
                f"| {i} | {e['samples_per_s']:,.1f} | {e['wait_fraction']:.0%} | "
                f"{e['first_batch_s']:.2f} | {e['max_batch_s']:.2f} | {e['batch_time_cv']:.2f} | "
                f"{_mib(e['main_rss_bytes'])} | {_mib(e['workers_uss_bytes'])} | {growth} | "
                f"{e['worker_deaths']} | {_mib(e['shm_used_bytes'])} | {gpu} | "
                f"{_mib(e['net_bytes_recv'])} |"
            )
        return "\n".join(lines)


def items_in(batch) -> int:
    """Samples in a batch: the first dimension of a tensor or array, or of a tuple's or dict's
    first entry; 1 for anything without a length (a `batch_size=None` loader's items)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    try:
        return len(batch)
    except TypeError:  # scalars, 0-dim tensors
        return 1


class _Epoch:
    """Running figures of one epoch."""

    def __init__(self, index: int):
        self.index = index
        self.batches = self.samples = 0
        self.wait_s = self.step_s = 0.0
        self.waits: list[float] = []
        self.first_batch_s = 0.0
        self.first_items = 0
        self.last_sample = 0.0
        self.main_rss = self.workers_uss = self.workers_pss = self.workers = 0
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
        mean = sum(steady) / len(steady) if steady else 0.0
        var = sum((w - mean) ** 2 for w in steady) / len(steady) if steady else 0.0
        return {
            "batches": self.batches,
            "samples": self.samples,
            "seconds": self.seconds,
            "samples_per_s": self.samples / self.seconds if self.seconds > 0 else 0.0,
            "steady_samples_per_s": _ratio(self.samples - self.first_items, steady_s),
            "wait_s": self.wait_s,
            "step_s": self.step_s,
            "steady_wait_s": steady_wait,
            "steady_s": steady_s,
            "wait_fraction": _ratio(steady_wait, steady_s),
            "wait_fraction_with_start": _ratio(self.wait_s, self.wait_s + self.step_s),
            "first_batch_s": self.first_batch_s,
            "max_batch_s": max(steady, default=self.waits[0] if self.waits else 0.0),
            "batch_time_cv": math.sqrt(var) / mean if mean > 0 else 0.0,
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
            "gpu_util": sum(self.gpu_util) / len(self.gpu_util) if self.gpu_util else None,
            "gpu_memory_bytes": self.gpu_memory,
            "net_bytes_recv": self.net_bytes,
            "prefetch": prefetch,
        }


def _realised_mixture(loader, samples: int) -> dict[str, float] | None:
    """The share of each source among the `samples` samples this rank's loop received in the
    epoch (after the batches a resume skipped), from the loader's `MixtureSampler` (its sampler
    or batch sampler, or a bucketing sampler's `mixture`); None without one."""
    inner = getattr(loader, "loader", loader)
    current = getattr(getattr(inner, "_passes", None), "current", None)
    skip = int(getattr(current, "skip", 0) or 0)  # batches of the epoch a resume skipped
    batch_sampler = getattr(inner, "batch_sampler", None)
    for candidate in (
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(inner, "sampler", None),
    ):
        if hasattr(candidate, "source_counts"):
            if getattr(candidate, "batch_size", None) is not None and candidate is batch_sampler:
                # a batch sampler resumes by itself: this pass's batches begin at its global
                # position
                mine = [
                    int(i)
                    for b in candidate._batch_plan(candidate.epoch, candidate._begin)[skip:]
                    for i in b
                ]
                found = np.bincount(
                    candidate.source_of(mine[:samples]), minlength=len(candidate.names)
                )
                counts = {name: int(c) for name, c in zip(candidate.names, found, strict=True)}
            else:
                counts = candidate.source_counts(
                    samples, start=skip * int(getattr(inner, "batch_size", None) or 1)
                )
            break
        mixture = getattr(candidate, "mixture", None)
        if hasattr(mixture, "source_of") and hasattr(candidate, "_plan"):  # mixed, then bucketed
            begin = int(
                getattr(candidate, "_begin", 0)
            )  # a bucketing sampler resumes by itself too
            mine = [
                int(i) for batch in candidate._plan(candidate.epoch, begin)[skip:] for i in batch
            ][:samples]
            found = (
                np.bincount(mixture.source_of(mine), minlength=len(mixture.names)) if mine else []
            )
            counts = {name: int(c) for name, c in zip(mixture.names, found, strict=False)}
            break
    else:
        return None
    total = sum(counts.values())
    return {name: count / total for name, count in counts.items()} if total else None


def _diagnose(row: dict[str, Any], monitor: LoaderMonitor) -> list[str]:
    """The warnings an epoch earns, each with its likely cause and fix."""
    n = len(monitor.epochs) - 1
    out = []
    threads = getattr(monitor.loader, "read_ahead_threads", None)
    if row["batches"] > 1 and row["wait_fraction"] > monitor.warn_wait_fraction:
        fix = (
            f"Likely cause: the {threads} thread(s) of the thread path (ThreadLoader) cannot make "
            "batches as fast as the step uses them, or their work holds the GIL. Fix: a decoded "
            "cache (build_image_cache, build_token_cache) if there is none, more CPUs for this "
            "rank, or make_loader(..., path='workers') with `recipes tune` for work that is "
            "Python per item."
            if threads is not None
            else "Likely cause: too few workers for the decode cost, or slow storage. Fix: "
            "`recipes tune` / autotune() for num_workers and prefetch_factor, a decoded cache "
            "(build_image_cache, build_token_cache), or PrefetchCache for remote data."
        )
        out.append(
            f"epoch {n}: the loop waited for data {row['wait_fraction']:.0%} of the time "
            f"(threshold {monitor.warn_wait_fraction:.0%}); the step is starved. {fix}"
        )
    if row["max_batch_s"] > monitor.warn_batch_seconds and row["batches"] > 1:
        out.append(
            f"epoch {n}: a batch took {row['max_batch_s']:.2f} s to arrive (threshold "
            f"{monitor.warn_batch_seconds:.2f} s; batch-time CV {row['batch_time_cv']:.2f}). "
            "Likely cause: a slow read (remote storage, a huge or corrupt file) or a straggling "
            "worker. Fix: PrefetchCache for remote shards, a higher prefetch_factor "
            "(ThreadLoader: `prefetch`) to absorb jitter, or check the files the slow indices map "
            "to."
        )
    if row["first_batch_s"] > monitor.warn_first_batch_seconds:
        out.append(
            f"epoch {n}: the first batch took {row['first_batch_s']:.1f} s (threshold "
            f"{monitor.warn_first_batch_seconds:.1f} s). Likely cause: workers started with spawn "
            "or forkserver re-import torch, or a heavy dataset constructor. Fix: the fork start "
            "method (make_loader's default) and persistent_workers=True."
        )
    growth = row["memory_growth"]
    if growth is not None and growth > monitor.warn_memory_growth:
        out.append(
            f"epoch {n}: loader memory grew {growth:.0%} since the last epoch (threshold "
            f"{monitor.warn_memory_growth:.0%}). Likely cause: forked workers touching Python "
            "lists or dicts of the index (copy-on-read), or a per-worker cache without a bound. "
            "Fix: keep the index in numpy arrays or PackedStrings, bound caches."
        )
    for code in row["worker_exit_codes"]:
        cause = (
            "killed by SIGKILL, usually the out-of-memory killer"
            if code == -9
            else "a bus error, usually a full /dev/shm"
            if code == -7
            else f"exit code {code}"
        )
        out.append(
            f"epoch {n}: a DataLoader worker died ({cause}). Fix: fewer workers, "
            "prefetch_factor=1, profile='memory', or a larger /dev/shm (docker --shm-size)."
        )
    return out


def _growth(previous: dict | None, row: dict) -> float | None:
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


MIN_GROWTH_BYTES = 16 * 2**20


def _net_bytes() -> int | None:
    import psutil

    with _quiet():
        return psutil.net_io_counters().bytes_recv
    return None


class _quiet:
    """Suppresses the errors of readings that a sandbox may refuse."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb) -> bool:
        return kind is not None and issubclass(
            kind, (OSError, RuntimeError, AttributeError, ValueError)
        )


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"
