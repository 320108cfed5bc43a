"""Packed strings and index checks: a million paths without a million Python objects.

Use when: a dataset over many files is read by forked DataLoader workers.
- `PackedStrings`: a million paths as two numpy buffers, not a million `str` objects, so a
  forked worker's memory stays flat instead of growing toward a copy of the list
  (NOTE [copy-on-read] below, pytorch#13246). ~0.3 us per item.
- `resolve_index(es)`: Python-style indices (negative from the end) with one error message.
Cost: 1 byte per UTF-8 byte plus 8 per string; ~0.3 us per item read.
Adapt here: nothing.
Trade-off: immutable; build a new one to change it.
Copy with: nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

# NOTE [copy-on-read]
# A forked DataLoader worker shares its parent's memory pages until one of them writes to a
# page; then the kernel copies that page into the writer (copy-on-write). In Python a read is a
# write: every access to an object changes its reference count, in the object's header. So a
# worker that reads a Python list, dict or tuple of many objects (paths, labels, offsets) copies
# each page of them it touches, and its memory grows, epoch after epoch, toward a private copy
# of the whole container: one per worker (pytorch#13246; `recipes bench common` measures it:
# 46.6 MiB per worker for a list of 1,000,000 paths, 0.4 MiB for `PackedStrings`). A numpy
# array holds its items as raw bytes behind one object: a read touches one reference count,
# never the pages of the items, and they stay shared. So whatever workers read per item is kept
# in numpy arrays (`PackedStrings` for strings), never in Python containers: indexes, per-item
# flags, offsets. `make_loader` warns about large Python containers on a dataset, and
# `LoaderMonitor` about worker memory that grows between epochs.


# ---- packed strings -------------------------------------------------------------------
class PackedStrings(Sequence[str]):
    """Strings stored as `data: uint8[total_bytes]` and `offsets: int64[N + 1]` (see
    NOTE [copy-on-read]).

    Args:
        strings: any iterable of `str` (or `os.PathLike`, stored as `os.fspath`).

    Example:
        >>> paths = PackedStrings(["a/1.jpg", "b/2.jpg"])
        >>> paths[1], len(paths)
        ('b/2.jpg', 2)
    """

    __slots__ = ("_data", "_offsets")

    def __init__(self, strings: Iterable[str] = ()):
        encoded = [_encode(s) for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        self._offsets = offsets
        self._data = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        del encoded

    @classmethod
    def from_buffers(cls, data: np.ndarray, offsets: np.ndarray) -> PackedStrings:
        """Wraps existing buffers (e.g. loaded from a cache file) without copying."""
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
            raise ValueError(
                "`offsets` must be a 1-D array starting at 0, as PackedStrings writes it."
            )
        if offsets[-1] != len(data):
            raise ValueError(
                f"`offsets` ends at {int(offsets[-1])} but `data` holds {len(data)} bytes; "
                "the buffers do not belong together."
            )
        obj = cls.__new__(cls)
        obj._data = np.asarray(data, dtype=np.uint8)
        obj._offsets = np.asarray(offsets, dtype=np.int64)
        return obj

    @property
    def data(self) -> np.ndarray:
        return self._data

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets

    @property
    def nbytes(self) -> int:
        return self._data.nbytes + self._offsets.nbytes

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> PackedStrings: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return PackedStrings(self[i] for i in range(*index.indices(len(self))))
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for PackedStrings of length {n}")
        start = self._offsets[i]
        end = self._offsets[i + 1]
        return self._data[start:end].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedStrings):
            return np.array_equal(self._offsets, other._offsets) and np.array_equal(
                self._data, other._data
            )
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[: min(3, len(self))])
        more = ", ..." if len(self) > 3 else ""
        return f"PackedStrings([{head}{more}], n={len(self)}, nbytes={self.nbytes})"

    def __getstate__(self):
        return {"data": self._data, "offsets": self._offsets}

    def __setstate__(self, state):
        self._data = state["data"]
        self._offsets = state["offsets"]


def _encode(value) -> bytes:
    if not isinstance(value, str):
        value = os.fspath(value)
        if isinstance(value, bytes):
            return value
    return value.encode("utf-8", "surrogateescape")


# ---- index checks -----------------------------------------------------------------------
def resolve_index(index, n: int, what: str) -> int:
    """`index` as a position in `range(n)`; negative indices count from the end.

    Raises:
        IndexError: outside `[-n, n)`, naming `what` (e.g. "the 50 samples in /cache/x").
    """
    i = int(index)
    if not -n <= i < n:
        raise IndexError(f"index {index} is out of range for {what}")
    return i % n


def resolve_indices(indices, n: int, what: str) -> np.ndarray:
    """`resolve_index` for a whole batch, vectorised: an int64 numpy array in `range(n)`."""
    idx = np.asarray(indices, dtype=np.int64)
    outside = (idx < -n) | (idx >= n)
    if outside.any():
        raise IndexError(f"index {int(idx[outside][0])} is out of range for {what}")
    return idx % n if n else idx
