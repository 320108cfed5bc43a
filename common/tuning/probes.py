"""Readings of a running loader's resources: process memory, the GPU (NVML), PrefetchCaches.

Use when: monitoring (`LoaderMonitor`) or tuning (`autotune`) needs figures from outside the
loader. Every reading degrades to None where the platform refuses it (no NVML, no smaps in a
sandbox), so callers never need a try.
Cost: `process_memory` reads `/proc/<pid>/smaps_rollup` of each process (a few ms each);
`gpu_reading` one NVML query after a one-off init.
Adapt here: `prefetch_caches` for datasets that hold their cache deeper than one attribute.
`PeakMemory` samples the process tree's PSS in a thread (every 200 ms: a reading costs
~10 ms of CPU, so sampling faster would slow what it measures on 2 cores).
Trade-off: USS (memory only this process holds) shows a worker's own growth; PSS splits shared
pages fairly, so the sum over processes is the real total.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py,
  common/remote/cache_download.py, common/remote/object_download.py, common/remote/object_urls.py,
  common/remote/prefetch_cache.py, common/remote/process_downloads.py,
  common/remote/ranged_download.py, common/remote/retries.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import os
import threading

from recipes.common.remote.prefetch_cache import PrefetchCache

_NVML: dict = {}


def process_memory(worker_pids: list[int]) -> tuple[int, dict[int, tuple[int, int] | None]]:
    """The main process's RSS, and `(USS, PSS)` bytes per worker pid (None: gone or unreadable)."""
    import psutil

    main = psutil.Process().memory_info().rss
    workers: dict[int, tuple[int, int] | None] = {}
    for pid in worker_pids:
        try:
            info = psutil.Process(pid).memory_full_info()
            workers[pid] = (getattr(info, "uss", info.rss), getattr(info, "pss", info.rss))
        except (psutil.Error, OSError):
            workers[pid] = None
    return main, workers


def gpu_reading() -> tuple[float, int] | None:
    """`(utilisation %, memory used bytes)` of this process's CUDA device, or None without NVML.

    Never initialises CUDA: the device index is torch's current one only when CUDA is
    already initialised, else `LOCAL_RANK` (torchrun) or 0.
    """
    if _NVML.get("failed"):
        return None
    try:
        if "handle" not in _NVML:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            _NVML["module"] = pynvml
            _NVML["handle"] = pynvml.nvmlDeviceGetHandleByIndex(_device_index())
        nvml = _NVML["module"]
        handle = _NVML["handle"]
        util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        memory = nvml.nvmlDeviceGetMemoryInfo(handle).used
        return float(util), int(memory)
    except Exception:  # ImportError, NVMLError (no driver, no device), anything a sandbox does
        _NVML["failed"] = True
        return None


def _device_index() -> int:
    import torch

    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def prefetch_caches(loader) -> list:
    """The `PrefetchCache`s a loader's dataset reads through (its attributes, one level deep,
    and those of a wrapped `.dataset`, as `Subset` has)."""
    found = []
    seen = set()
    dataset = getattr(loader, "dataset", None)
    for holder in (dataset, getattr(dataset, "dataset", None)):
        if holder is None or not hasattr(holder, "__dict__"):
            continue
        for value in vars(holder).values():
            if isinstance(value, PrefetchCache) and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


def tree_memory_bytes() -> int:
    """PSS of this process and all its children (RSS where PSS is unavailable)."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
            total += getattr(info, "pss", info.rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class PeakMemory:
    """Context manager sampling `tree_memory_bytes()` in a thread; `.peak` after exit."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_memory_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self.peak = tree_memory_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, tree_memory_bytes())
