"""Measure how much a dataset grows the memory of forked DataLoader workers.

Use when: worker RSS climbs epoch after epoch and you suspect copy-on-read (pytorch#13246):
Python lists/dicts of many objects in the Dataset get their pages copied into every worker
as soon as the worker reads them (refcount writes). Run one pass and compare the USS (memory
unique to each worker) before and after.
Cost: one pass over the dataset, plus one `/proc/<pid>/smaps` read per batch.
Adapt here: `batch_size` (items per USS reading) and `num_workers`.
Trade-off: measures USS, which counts copied pages exactly but also the worker's own
allocations (decode buffers); compare two layouts of the same data, as `recipes bench common`
does, rather than reading one number alone.
Copy with: nothing.
"""

from __future__ import annotations

import multiprocessing

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info


class _USSProbe(Dataset):
    """Reads `inner[i]` for a batch of indices and reports the worker's USS around it."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitems__(self, indices):
        import psutil

        process = psutil.Process()
        before = process.memory_full_info().uss
        for i in indices:
            self.inner[i]
        after = process.memory_full_info().uss
        info = get_worker_info()
        return [(info.id if info else -1, before, after)]


def _identity(batch):
    return batch


def measure_worker_memory_growth(
    dataset, *, num_workers: int = 2, batch_size: int = 10_000
) -> list[int]:
    """Bytes each forked worker's USS grew by during one pass over `dataset`.

    Args:
        dataset: a map-style dataset (anything with `__len__` and `__getitem__`).
        num_workers: forked DataLoader workers.
        batch_size: indices read between two USS readings.

    Returns:
        One growth figure per worker (last reading minus the first).

    Raises:
        ValueError: when `num_workers` is not positive.
    """
    if num_workers <= 0:
        raise ValueError(f"`num_workers` must be positive, but is {num_workers!r} instead.")
    loader = DataLoader(
        _USSProbe(dataset),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=_identity,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    with torch.no_grad():
        for batch in loader:
            for worker, before, after in batch:
                first.setdefault(worker, before)
                last[worker] = after
    return [last[w] - first[w] for w in sorted(first)]
