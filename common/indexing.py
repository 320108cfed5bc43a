"""Index checks shared by the map-style datasets: one rule, one error message.

Use when: a dataset's `__getitem__` takes Python-style indices (negative counts from the end).
Cost: a comparison.
Adapt here: nothing.
Trade-off: none; a wrong index fails here, naming the dataset, instead of deep in a memory map.
"""

from __future__ import annotations


def resolve_index(index, n: int, what: str) -> int:
    """`index` as a position in `range(n)`; negative indices count from the end.

    Raises:
        IndexError: outside `[-n, n)`, naming `what` (e.g. "the 50 samples in /cache/x").
    """
    i = int(index)
    if not -n <= i < n:
        raise IndexError(f"index {index} is out of range for {what}")
    return i % n


def resolve_indices(indices, n: int, what: str):
    """`resolve_index` for a whole batch, vectorised: an int64 numpy array in `range(n)`."""
    import numpy as np

    idx = np.asarray(indices, dtype=np.int64)
    outside = (idx < -n) | (idx >= n)
    if outside.any():
        raise IndexError(f"index {int(idx[outside][0])} is out of range for {what}")
    return idx % n if n else idx
