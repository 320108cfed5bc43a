"""Per-batch random seeds: a map-style dataset's own random draws follow the batch, not the worker.

Use when: `__getitem__` draws augmentations from torch's, NumPy's or Python's global random
generators (`torch.rand`, `np.random.rand`, `random.random`, torchvision's random transforms)
and a resumed run must be bit-identical to the uninterrupted one (issue #28). Each batch of
index lists the loader's sampler yields carries a seed made from `(the loader's seed, epoch,
the batch's position in the epoch)`; the process that makes the batch seeds the three global
generators with it just before reading the batch. The draws then depend only on the batch:
the same after a resume, with another number of workers, or with none.
Cost: per batch, one mix of three integers in the main process and one seeding of the three
generators where the batch is made (about 20 us); without workers, the loop's own generator
states are saved before and restored after the read (about 50 us more), so the training
step's random stream (dropout, noise) does not depend on the dataset's draws.
Adapt here: `seed_globals` (which generators are seeded).
Trade-off: draws come from per-batch seeds, not one stream per worker: two runs with the same
seed draw the same augmentations whatever the workers, and a `worker_init_fn` that seeds the
generators is overridden batch by batch. Index lists and tuples (given to the dataset as
lists) and single indices (Python or NumPy integers, given as ints) carry a seed; a batch
sampler that yields arrays or tensors keeps DataLoader's per-worker streams (the loader warns
once). An iterable dataset with no `resume_after` is seeded once per pass in each worker, just
before its `iter(dataset)` (`dataset_state.py`), from `(the loader's seed, epoch, worker)`:
its draws then replay when its epoch is read again; after a mid-epoch resume a worker's later
draws are the uninterrupted run's when its own state holds the generator it draws from
(torchdata's rule). Not seeded: a `__getitem__` run in the thread path's pool threads, which
share the generators (use `read_batch`/`read_items(indices, rng)` there).
Copy with: nothing.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import numpy as np
import torch

_MASK = 2**64 - 1


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """A 63-bit seed for batch `position` of `epoch` (splitmix64 over the three numbers)."""
    x = (
        seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB + 1
    ) & _MASK
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * factor) & _MASK
    return (x ^ (x >> 31)) >> 1


def seed_globals(seed: int) -> None:
    """Seeds torch's CPU generator (never CUDA's: the training step's), NumPy's and Python's."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


class SeededBatch(list):
    """An index list that carries its batch's seed. Unpickled in a DataLoader worker (it
    travels through the index queue), it makes sure that worker's fetcher seeds the globals."""

    __slots__ = ("seed",)

    def __init__(self, items, seed: int):
        super().__init__(items)
        self.seed = seed

    def __reduce__(self):
        return _arrive, (SeededBatch, list(self), self.seed)


class SeededIndex(int):
    """A single index (`batch_size=None`) that carries its seed, as `SeededBatch`."""

    def __new__(cls, value: int, seed: int):
        index = super().__new__(cls, value)
        index.seed = seed
        return index

    def __reduce__(self):
        return _arrive, (SeededIndex, int(self), self.seed)


class SeededNone:
    """The index of an iterable dataset's fetch without batching (which reads no index),
    carrying its seed."""

    __slots__ = ("seed",)

    def __init__(self, seed: int):
        self.seed = seed


def seeded(item, seed: int):
    """`item` (what a sampler yielded) carrying `seed`: an index list or tuple (as a list), an
    index (Python's or NumPy's integer, as an int), None (an iterable dataset's unbatched fetch);
    anything else is returned as it is."""
    if type(item) is list or type(item) is tuple:
        return SeededBatch(item, seed)
    if type(item) is int or isinstance(item, np.integer):
        return SeededIndex(int(item), seed)
    if item is None:
        return SeededNone(seed)
    return item


def _arrive(kind, value, seed):
    _install_in_worker()
    return kind(value, seed)


_INSTALLED = False


def _install_in_worker() -> None:
    """In a worker process, once: its map-style fetcher seeds the globals from the index it
    fetches (the fetch follows the index's arrival at once, in the worker's loop)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.utils.data import get_worker_info
    from torch.utils.data._utils import fetch

    if (
        get_worker_info() is None
    ):  # unpickled in the main process (a copy): its fetches stay as they are
        return

    plain = fetch._MapDatasetFetcher.fetch

    def fetch_seeded(self, possibly_batched_index):
        seed = getattr(possibly_batched_index, "seed", None)
        if seed is not None:
            seed_globals(seed)
        return plain(self, possibly_batched_index)

    fetch._MapDatasetFetcher.fetch = fetch_seeded
    _INSTALLED = True


class _GlobalStates(NamedTuple):
    """The global random generators' states: torch's, NumPy's and Python's."""

    torch: Any
    numpy: Any
    python: Any


class SeededFetcher:
    """The fetcher of an iterator without workers: each batch read under its seed, the loop's
    own generator states put back afterwards."""

    def __init__(self, inner):
        self.inner = inner

    def fetch(self, possibly_batched_index):
        seed = getattr(possibly_batched_index, "seed", None)
        if seed is None:
            return self.inner.fetch(possibly_batched_index)
        saved = _GlobalStates(
            torch.default_generator.get_state(), np.random.get_state(), random.getstate()
        )
        try:
            seed_globals(seed)
            return self.inner.fetch(possibly_batched_index)
        finally:
            torch.default_generator.set_state(saved.torch)
            np.random.set_state(saved.numpy)
            random.setstate(saved.python)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
