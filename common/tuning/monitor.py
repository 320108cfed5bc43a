"""LoaderMonitor: is the training loop waiting for data, and is the loader healthy?

Use when: always, in production training. Iterate the monitor in place of the loader; it times
every `next(loader)` against the time your step takes, and once per epoch reads the memory of
the main process and of each worker, worker deaths, `/dev/shm`, the GPU (NVML), network
bytes and `PrefetchCache` counters. Past a threshold it warns (`LoaderWarning`) with the
likely cause and the fix. `plot()` draws the run's timeline (step by step: wait, compute, memory).
Cost: two `perf_counter` calls and a bounded timeline's few numpy writes per batch; a resource
reading (a few ms per process: smaps) at the first batch, then at most every `sample_seconds`.
Adapt here: the thresholds (the defaults are the production rules: a batch over 1 s, memory
growth over 20% between epochs, data wait over 20%), `items_in` for your batch type; the
warnings' rules are a table in `monitor_rules.py`, an epoch's figures in `monitor_epoch.py`.
Trade-off: step time is what the CPU sees. CUDA runs asynchronously, so a loop that never
synchronises (no `loss.item()`, no logging) shows step time in the next `next()` instead;
`profile_trace` shows the exact timeline.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py, common/loader_warning.py,
  common/remote/cache_download.py, common/remote/object_download.py, common/remote/object_urls.py,
  common/remote/prefetch_cache.py, common/remote/process_downloads.py,
  common/remote/ranged_download.py, common/remote/retries.py, common/tuning/monitor_epoch.py,
  common/tuning/monitor_plot.py, common/tuning/monitor_rules.py, common/tuning/probes.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Any

from recipes.common.loader_warning import LoaderWarning
from recipes.common.tuning.monitor_epoch import (
    EpochFigures,
    memory_growth,
    ratio,
    realised_mixture,
)
from recipes.common.tuning.monitor_plot import StepTimeline, plot_timeline
from recipes.common.tuning.monitor_rules import diagnose
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
        epoch = EpochFigures(len(self.epochs))
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
                    if epoch.batches:
                        epoch.step_s += asked - handed_back
                    break
                except RuntimeError:
                    # record the deaths behind "worker exited unexpectedly"
                    self._sample(epoch, iterator)
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
    def _sample(self, epoch: EpochFigures, iterator) -> None:
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
        shm = _shm_used()
        if shm is not None:
            epoch.shm_used = max(epoch.shm_used or 0, shm)
        gpu = gpu_reading()
        if gpu is not None:
            epoch.gpu_util.append(gpu[0])
            epoch.gpu_memory = max(epoch.gpu_memory or 0, gpu[1])

    def _close(
        self, epoch: EpochFigures, begin: float, net_before: int | None, caches_before: dict
    ) -> None:
        epoch.seconds = time.perf_counter() - begin
        net = _net_bytes()
        if net is not None and net_before is not None:
            epoch.net_bytes = net - net_before
        prefetch = None
        if caches_before:
            prefetch = self._prefetch_counts(caches_before)
        row = epoch.row(prefetch)
        mixture = realised_mixture(self.loader, row["samples"])
        row["sources"] = None
        row["sources_tokens"] = None
        row["sources_target"] = None
        if mixture is not None:
            row["sources"] = mixture.samples
            row["sources_tokens"] = mixture.tokens
            row["sources_target"] = mixture.target
        # The first epoch is the workers' warm-up (forked, then touching what they use): growth
        # is judged from the second epoch on.
        previous = None
        if len(self.epochs) >= 2:
            previous = self.epochs[-1]
        row["memory_growth"] = memory_growth(previous, row)
        self.epochs.append(row)
        for message in diagnose(row, self):
            warnings.warn(message, LoaderWarning, stacklevel=3)

    def _prefetch_counts(self, caches_before: dict) -> dict[str, int]:
        """The `PrefetchCache` counters of the epoch: hits, misses, bytes downloaded."""
        prefetch = {"hits": 0, "misses": 0, "bytes_downloaded": 0}
        for cache in prefetch_caches(self.loader):
            before = caches_before.get(id(cache), {})
            for key, value in cache.stats().items():
                prefetch[key] += value - before.get(key, 0)
        return prefetch

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
        proportion of each source in the latest epoch's samples, by name; None without one),
        `sources_tokens` (the same in tokens, for a mixture with `lengths`; None without, and
        for an epoch an index-mode mixture resumed mid-way by itself) and
        `sources_target` (the mixture's weights in force at the epoch's end: the loop's, the
        schedule's or the fixed ones).
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
            samples_per_s=ratio(total["samples"], total["seconds"]),
            wait_fraction=ratio(total["steady_wait_s"], total["steady_s"]),
            wait_fraction_with_start=ratio(total["wait_s"], total["wait_s"] + total["step_s"]),
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
            gpu = "-"
            if e["gpu_util"] is not None:
                gpu = f"{e['gpu_util']:.0f}%"
            lines.append(
                f"| {i} | {e['samples_per_s']:,.1f} | {e['wait_fraction']:.0%} | "
                f"{e['first_batch_s']:.2f} | {e['max_batch_s']:.2f} | {e['batch_time_cv']:.2f} | "
                f"{_mib(e['main_rss_bytes'])} | {_mib(e['workers_uss_bytes'])} | "
                f"{_signed_percent(e['memory_growth'])} | {e['worker_deaths']} | "
                f"{_mib(e['shm_used_bytes'])} | {gpu} | {_mib(e['net_bytes_recv'])} |"
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


def _shm_used() -> int | None:
    """Bytes used in `/dev/shm`, None where there is none or it cannot be read."""
    if not os.path.isdir("/dev/shm"):
        return None
    with _quiet():
        return shutil.disk_usage("/dev/shm").used
    return None


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


def _mib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**20:,.0f}"


def _signed_percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}"
