"""How many DataLoader workers, and how much memory they hold in flight.

Use when: picking `num_workers` for a machine you did not size yourself (a container, a pod,
a torchrun node with 8 ranks).
Cost: arithmetic over a `Resources` snapshot (`detect_resources()` when not given).
Adapt here: `reserved_cpus`, `max_workers`, and the 2 GiB-per-worker memory term.
Trade-off: a rule of thumb that is right for decode-bound loaders; an I/O-bound loader
(remote storage) may want more workers than CPUs. Measure with `recipes bench`.

The usual rule, `min(cpus // 2, gpus * 4, available_RAM_GiB // 2)`, goes wrong twice: in
containers and under torchrun it reads host figures and ignores the other ranks on the node,
and on many-core nodes with one GPU its GPU term starves a fast step (4 workers on 16 cores
left an H200 waiting 70% of the time). `smart_num_workers` uses effective, per-rank figures
and gives the spare cores to workers; `autotune` measures the real optimum.
Copy with: common/sizing/resources.py.
"""

from __future__ import annotations

import os

from recipes.common.sizing.resources import GiB, Resources, detect_resources

# Each worker is a full Python process with torch imported (~0.3-0.5 GiB resident) plus the
# batches it prepares; 2 GiB per worker leaves room for decode buffers and augmentation.
WORKER_MEMORY_BYTES = 2 * GiB


def local_world_size_from_env() -> int:
    """Ranks on this node: torchrun's `LOCAL_WORLD_SIZE`, else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(
            f"`LOCAL_WORLD_SIZE` must be a positive integer, but is {value!r} instead."
        ) from None


def resources_or_detect(resources: Resources | None) -> Resources:
    """`resources`, or a fresh `detect_resources()` snapshot when None."""
    if resources is None:
        return detect_resources()
    return resources


def ranks_or_env(local_world_size: int | None) -> int:
    """`local_world_size`, or the ranks on this node from the environment when None."""
    if local_world_size is None:
        return local_world_size_from_env()
    return local_world_size


def smart_num_workers(
    resources: Resources | None = None,
    *,
    local_world_size: int | None = None,
    workers_per_gpu: int | None = None,
    max_workers: int = 16,
) -> int:
    """Workers per rank for a decode-bound loader.

    `min(cpus - reserved, memory_GiB // 2, max_workers)`, each term per rank:

    - `cpus - reserved`: effective CPUs of this rank (affinity and cgroup quota, divided by
      the ranks on this node), less `1 + cpus // 8` kept for the main process (the training
      step's kernel launches), the pin-memory thread and the OS. The older "4 workers per GPU"
      rule left a resnet50 step on one H200 of a 16-core node waiting for data 70% of the time
      (4 workers); 12 workers cut that to 31% (issue #9).
    - `memory_GiB // 2`: effective available memory of this rank (cgroup limit when set,
      divided by the ranks on this node), at 2 GiB per worker.

    The result is at least 1 when the rank has a CPU to spare beyond the main process
    (2 or more CPUs), else 0, and never above `max_workers`. `autotune` measures instead.

    Args:
        resources: a snapshot; `detect_resources()` when None.
        local_world_size: ranks on this node; `LOCAL_WORLD_SIZE` (torchrun) when None, else 1.
        workers_per_gpu: an optional cap of this many workers per GPU of the rank (the old
            rule's term; None: no GPU term).
        max_workers: the hard ceiling; beyond ~16 workers returns vanish and memory grows.

    Returns:
        The number of workers to pass as `num_workers`.

    Raises:
        ValueError: for non-positive arguments.
    """
    _check_positive(max_workers=max_workers)
    if workers_per_gpu is not None:
        _check_positive(workers_per_gpu=workers_per_gpu)
    res = resources_or_detect(resources)
    ranks = ranks_or_env(local_world_size)
    _check_positive(local_world_size=ranks)

    cpus = res.cpus // ranks
    memory_per_rank = res.memory_available // ranks
    workers = min(cpus - reserved_cpus(cpus), memory_per_rank // WORKER_MEMORY_BYTES)
    if workers_per_gpu is not None:
        gpus_per_rank = 1
        if res.gpus:
            gpus_per_rank = max(1, res.gpus // ranks)
        workers = min(workers, gpus_per_rank * workers_per_gpu)
    if cpus >= 2:
        workers = max(workers, 1)
    return max(0, min(workers, max_workers))


def reserved_cpus(cpus: int) -> int:
    """CPUs of a rank kept from the workers: the main process, plus one per 8 for the
    pin-memory thread, intra-op threads and the OS."""
    return 1 + cpus // 8


def estimate_loader_memory(
    *,
    num_workers: int,
    batch_size: int,
    sample_bytes: int,
    prefetch_factor: int | None,
    margin: float = 0.4,
) -> int:
    """Bytes of batches a DataLoader holds in flight, with a safety margin.

    `num_workers * prefetch_factor` batches are in flight (each worker keeps `prefetch_factor`
    batches queued); with 0 workers one batch at a time. The margin (30-50% in practice)
    covers collate copies, pinned-memory copies and allocator slack.

    Args:
        num_workers: DataLoader workers.
        batch_size: samples per batch.
        sample_bytes: bytes of one collated sample.
        prefetch_factor: batches queued per worker (None counts as DataLoader's default, 2).
        margin: fraction added on top, e.g. 0.4 for 40%.

    Returns:
        Estimated bytes.
    """
    _check_non_negative(num_workers=num_workers, sample_bytes=sample_bytes, margin=margin)
    _check_positive(batch_size=batch_size)
    prefetch = prefetch_factor
    if prefetch is None:
        prefetch = 2
    batches = 1
    if num_workers > 0:
        batches = num_workers * prefetch
    return int(batches * batch_size * sample_bytes * (1.0 + margin))


def max_workers_for_memory(
    budget_bytes: int,
    *,
    batch_size: int,
    sample_bytes: int,
    prefetch_factor: int | None,
    margin: float = 0.4,
) -> int:
    """The most workers whose in-flight batches (`estimate_loader_memory`) fit in the budget."""
    per_worker = estimate_loader_memory(
        num_workers=1,
        batch_size=batch_size,
        sample_bytes=sample_bytes,
        prefetch_factor=prefetch_factor,
        margin=margin,
    )
    if per_worker <= 0:
        return 1 << 30
    return int(budget_bytes // per_worker)


def loader_memory_budget(resources: Resources, *, local_world_size: int = 1) -> int:
    """Bytes a rank's loader may hold in flight: half of its share of available memory.

    The other half is left to the model, the optimizer state and the rest of the process.
    """
    return resources.memory_available // max(1, local_world_size) // 2


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"`{name}` must be non-negative, but is {value!r} instead.")
