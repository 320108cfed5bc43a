"""What this machine (or container) really gives a data loader: CPUs, memory, /dev/shm, GPUs.

Use when: choosing `num_workers`, `prefetch_factor` and batch sizes. Host figures lie inside
containers: `os.cpu_count()` shows the host's 64 cores to a pod limited to 4, and
`psutil.virtual_memory()` shows host RAM to a container with an 8 GiB cgroup limit.
Cost: a handful of small file reads and one `statvfs`; no subprocesses, no CUDA initialisation.
Adapt here: `cgroup_root` and `shm_path` (tests point them at fake trees).
Trade-off: reads the cgroup files mounted at `cgroup_root` as containers see them; on a bare
host with nested cgroups the root files are absent and the host figures are used.
Copy with: nothing.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3

# cgroup v1 reports "no limit" as a huge page-aligned number (PAGE_COUNTER_MAX * page size).
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Resources:
    """A snapshot of what a data loader may use here.

    Attributes:
        cpus: effective CPUs: affinity, further limited by the cgroup quota (rounded up).
        cpus_logical: `os.cpu_count()`, the host's logical CPUs.
        memory_available: bytes effectively available: host available memory, or the cgroup
            limit minus its usage when that is smaller.
        memory_limit: the cgroup memory limit in bytes, or None when unlimited.
        shm_bytes: size of `/dev/shm` (0 when missing).
        shm_free: free bytes in `/dev/shm`.
        gpus: CUDA devices visible to torch (0 without CUDA).
        nofile_limit: soft `ulimit -n`.
        cpus_affinity: CPUs in this process's affinity mask.
        cpu_quota: the cgroup CPU quota in CPUs (e.g. 1.5), or None when unlimited.
        memory_total: host RAM in bytes.
        memory_usage: the cgroup's current usage in bytes, or None without a cgroup file.
    """

    cpus: int
    cpus_logical: int
    memory_available: int
    memory_limit: int | None
    shm_bytes: int
    shm_free: int
    gpus: int
    nofile_limit: int
    cpus_affinity: int = 0
    cpu_quota: float | None = None
    memory_total: int = 0
    memory_usage: int | None = None


def detect_resources(
    *, cgroup_root: str | os.PathLike = "/sys/fs/cgroup", shm_path: str | os.PathLike = "/dev/shm"
) -> Resources:
    """Reads CPUs, memory, shared memory, GPUs and the file limit as a container sees them.

    Args:
        cgroup_root: where the cgroup filesystem is mounted. cgroup v2 files sit directly under
            it (`cpu.max`, `memory.max`, `memory.current`); v1 files under `cpu/` (or
            `cpu,cpuacct/`) and `memory/`.
        shm_path: the shared-memory mount DataLoader workers send batches through.

    Returns:
        A frozen `Resources`.

    Example:
        >>> detect_resources().cpus >= 1
        True
    """
    import psutil

    root = Path(cgroup_root)
    affinity = _affinity_cpus()
    quota = _cpu_quota(root)
    cpus = affinity
    if quota is not None:
        cpus = max(1, min(affinity, math.ceil(quota)))

    vm = psutil.virtual_memory()
    limit, usage = _memory_limit_and_usage(root)
    if limit is not None and limit >= vm.total:
        limit = None  # a limit above host RAM limits nothing
    available = int(vm.available)
    if limit is not None:
        available = min(available, max(0, limit - (usage or 0)))

    shm_bytes, shm_free = _statvfs(shm_path)
    return Resources(
        cpus=cpus,
        cpus_logical=os.cpu_count() or 1,
        memory_available=available,
        memory_limit=limit,
        shm_bytes=shm_bytes,
        shm_free=shm_free,
        gpus=_gpu_count(),
        nofile_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        cpus_affinity=affinity,
        cpu_quota=quota,
        memory_total=int(vm.total),
        memory_usage=usage,
    )


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu_quota(root: Path) -> float | None:
    """The CPU quota in CPUs: v2 `cpu.max` ("max 100000" or "50000 100000"), else v1 CFS."""
    v2 = _read(root / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota == "max":
            return None
        return int(quota) / int(period or 100000)
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota = _read(root / sub / "cpu.cfs_quota_us")
        period = _read(root / sub / "cpu.cfs_period_us")
        if quota is None or not period:
            continue
        if int(quota) < 0:
            return None
        return int(quota) / int(period)
    return None


def _memory_limit_and_usage(root: Path) -> tuple[int | None, int | None]:
    """(limit, usage) in bytes from v2 `memory.max`/`memory.current`, else v1 files."""
    v2_limit = _read(root / "memory.max")
    if v2_limit is not None:
        usage = _bytes(_read(root / "memory.current"))
        if v2_limit == "max":
            return None, usage
        return int(v2_limit), usage
    limit = _bytes(_read(root / "memory" / "memory.limit_in_bytes"))
    usage = _bytes(_read(root / "memory" / "memory.usage_in_bytes"))
    if limit is not None and limit >= _V1_UNLIMITED:
        limit = None
    return limit, usage


def _bytes(text: str | None) -> int | None:
    """A cgroup file's number, None for a missing or empty file."""
    if not text:
        return None
    return int(text)


def _statvfs(path: str | os.PathLike) -> tuple[int, int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    # device_count() asks NVML and does not initialise CUDA, so fork stays safe afterwards.
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()
