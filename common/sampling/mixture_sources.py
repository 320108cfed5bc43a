"""MixtureSources: a mixture's sources as one `ConcatDataset` that reads a batch part by part.

Use when: a `MixtureSampler` draws from several map-style sources (token caches, image caches)
whose `__getitems__` reads a batch in one call: each part's indices go to it in one call, and
the items come back in the batch's order.
Cost: per batch, one sort of its indices by source and one reorder of the items (a C call);
a plain `ConcatDataset` reads item by item (`__getitem__` through `bisect`): on a token cache
about half the rate.
Adapt here: `read_items` (how one part's items are read).
Trade-off: a batch's items are read source by source, so a part without `__getitems__` is still
read item by item; indices are checked as a whole before any part is read.
Copy with: nothing.
"""

from __future__ import annotations

import operator

import numpy as np
from torch.utils.data import ConcatDataset


def read_items(source, indices: list[int]) -> list:
    """A source's items at `indices`: its one-call batch read where it has one."""
    if hasattr(source, "__getitems__"):
        return source.__getitems__(indices)
    return [source[i] for i in indices]


class MixtureSources(ConcatDataset):
    """`ConcatDataset(datasets)` that reads a batch part by part: each part's `__getitems__`
    (a token cache's one-call batch read) for its indices, the items back in the batch's order.
    A plain `ConcatDataset` reads item by item (`__getitem__` through `bisect`): on a token
    cache about half the rate. Use it for a `MixtureSampler`'s sources."""

    def __init__(self, datasets):
        super().__init__(datasets)
        # each source's first index
        self._starts = np.asarray([0, *self.cumulative_sizes[:-1]], dtype=np.int64)

    def __getitems__(self, indices: list[int]) -> list:
        if len(self.cumulative_sizes) == 1:
            return read_items(self.datasets[0], indices)
        wanted = self._wanted(indices)
        if not len(wanted):
            return []
        bounds = self._starts
        parts = bounds.searchsorted(wanted, side="right") - 1  # each index's source
        order = parts.argsort(kind="stable")  # the batch's indices source by source
        local = (wanted - bounds[parts])[order].tolist()
        got: list = []
        at = 0
        for part, count in enumerate(np.bincount(parts, minlength=len(self.datasets)).tolist()):
            if count:
                got += read_items(self.datasets[part], local[at : at + count])
                at += count
        if len(got) != len(order):
            raise RuntimeError(f"the sources returned {len(got)} items for {len(order)} indices.")
        if len(got) == 1:
            return got
        back = np.empty_like(order)
        back[order] = np.arange(len(order))  # each batch position's place in `got`
        return list(operator.itemgetter(*back.tolist())(got))  # the batch's order, in one C call

    def _wanted(self, indices: list[int]) -> np.ndarray:
        """`indices` as int64, negative ones counted from the end, checked in range."""
        n = len(self)
        try:
            wanted = np.fromiter(indices, np.int64, len(indices))
        except OverflowError:  # an index beyond int64 is beyond any dataset
            bad = next(int(i) for i in indices if not -(2**63) <= int(i) < 2**63)
            raise IndexError(
                f"index {bad} is out of range for the {n} samples of these sources."
            ) from None
        if not len(wanted):
            return wanted
        low = int(wanted.min())
        high = int(wanted.max())
        if low < -n or high >= n:
            bad = next(int(i) for i in wanted if not -n <= i < n)
            raise IndexError(f"index {bad} is out of range for the {n} samples of these sources.")
        if low < 0:
            wanted = np.where(wanted < 0, wanted + n, wanted)
        return wanted
