"""The thread paths' read-ahead into the next epoch: its first batches made while the loop takes the
last ones.

Use when: you read why a `ThreadLoader` (or `IsolatedLoader`) starts an epoch with batches
ready. Without it each epoch starts empty: the pool drains at the epoch's end (fewer batches
left than it has threads) and the loop waits a whole batch's time for the next epoch's first,
which costs a loader as fast as the step 5-9 points on epochs of 23 batches (`recipes bench
step`), as DataLoader's workers cost it too.
Cost: none on the epoch; between epochs, up to `prefetch` batches of the next epoch held (made
for nothing after the last epoch, or when the next epoch turns out to differ).
Adapt here: `forecast` (which orders can be known before their epoch begins).
Trade-off: a guess, checked before any use, made only for a dataset that says what its
batches depend on (`read_ahead_key()`, `loader_contract.ReadAheadKeyed`: `ImageFolderFast`'s
crop settings, resolution and cache; a `ConcatDataset` of such parts), from the end of a
loader's second pass on (a loader iterated once, an evaluation, makes nothing it does not
use). The next epoch is foreseen only when its order can be drawn without touching the
loader's: torch's `BatchSampler` over a `SequentialSampler`, a `RandomSampler` with a generator
(drawn from a copy of its state), a `DistributedSampler` or an `ElasticDistributedSampler`
(exactly those classes: `set_epoch` on a copy), for epoch + 1 at position 0. A batch made
ahead is used only when the real pass asks for the same indices at the same epoch and position,
with the same seed, pool and dataset key; the first difference drops the rest (a `set_epoch` to
another epoch, a loaded state, `set_resolution`, a closed loader). Each read checks the key as
it starts and ends (`read_if_unchanged`, in the isolated child too), so a setting changed
between epochs and set back is never served. So a batch is always the one its pass would have
made then, and the loader's state never sees the guess.
Copy with: nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import os
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, ConcatDataset, RandomSampler, SequentialSampler

# samplers whose order is a function of (seed, epoch) and whose set_epoch and iteration only
# rebind the copy's own attributes (exactly these classes: a subclass may do more in set_epoch)
_DEALS = (
    "torch.utils.data.distributed.DistributedSampler",
    "recipes.common.sampling.elastic_sampler.ElasticDistributedSampler",
)


# every NextEpoch with batches asked for (settle_reads_ahead)
_LIVE: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class ReadAt:
    """Where a batch is read: its indices, epoch, position in the epoch and draw seed."""

    indices: list[int]
    epoch: int
    position: int
    seed: int


@dataclass(frozen=True)
class MadeAhead:
    """A batch asked for ahead: its position, its indices and its `_Ahead` future."""

    position: int
    indices: list[int]
    ahead: _Ahead


class NextEpoch:
    """Batches of the epoch after `epoch`, asked of `pool` before that epoch began, in order."""

    def __init__(self, pool, epoch: int, batches, seed: int, key: Key | None):
        self.pool = pool
        self.epoch = epoch + 1
        self.seed = seed
        self.key = key  # read_ahead_key's
        self._batches = batches  # the foreseen index lists, drawn as room appears
        self.made: deque[MadeAhead] = deque()
        self._position = 0

    def extend(self, loader, room: int) -> None:
        """Asks for up to `room` more foreseen batches."""
        for _ in range(room):
            indices = next(self._batches, None)
            if indices is None:
                return
            indices = [int(i) for i in indices]
            pool = loader._pool
            at = ReadAt(indices, self.epoch, self._position, self.seed)
            future = _submit(pool, loader, at, self.key.token)
            ahead = _Ahead(future, loader, at)
            self.made.append(MadeAhead(self._position, indices, ahead))
            self._position += 1
            _LIVE.add(self)

    def take(self, loader, indices: list[int], epoch: int, position: int, key):
        """The batch made ahead for this draw (`key`: the dataset's `read_ahead_key` now), or None
        (then nothing made ahead is used again)."""
        if self.made:
            made = self.made[0]
            asked = ReadAt(indices, epoch, position, loader.seed)
            if (
                ReadAt(made.indices, self.epoch, made.position, self.seed) == asked
                and self.pool is loader._pool
                and self.key == key
            ):
                self.made.popleft()
                return made.ahead
        self.cancel()
        return None

    def cancel(self) -> None:
        while self.made:
            self.made.popleft().ahead.cancel()
        self._batches = iter(())


def _submit(pool, loader, at: ReadAt, token):
    """Asks `pool` (threads of this process, or the isolated child) for the batch `at`. Each read
    checks the dataset's key as it starts and ends: a change between epochs (one set back before
    the next epoch too) makes it CHANGED, never a batch of the other setting."""
    if isinstance(pool, ThreadPoolExecutor):
        return pool.submit(
            read_if_unchanged, loader, token, at.indices, at.epoch, at.position, at.seed
        )
    return pool.submit(loader._read, at.indices, at.epoch, at.position, at.seed, token=token)


class _Changed:
    """A read ahead's answer when the dataset's key changed under it: read anew in its epoch."""


CHANGED = _Changed()


def read_if_unchanged(loader, token, indices, epoch: int, position: int, seed: int):
    """The batch, or CHANGED when the dataset's key (`token`: as the read was asked for; None: no
    check) differs as the read starts or ends."""

    def changed() -> bool:
        return token is not None and getattr(read_ahead_key(loader.dataset), "token", None) != token

    if changed():
        return CHANGED
    batch = loader._read(indices, epoch, position, seed)
    if changed():
        return CHANGED
    return batch


class _Ahead:
    """A batch asked for ahead, as `_Batches` holds it: read anew in its epoch if it came back
    CHANGED."""

    def __init__(self, future, loader, at: ReadAt):
        self.future = future
        self._loader = loader
        self._at = at

    def result(self):
        batch = self.future.result()
        if batch is CHANGED:
            at = self._at
            pool = self._loader._pool
            batch = pool.submit(self._loader._read, at.indices, at.epoch, at.position).result()
        return batch

    def cancel(self) -> bool:
        return self.future.cancel()


def _forget_in_child() -> None:
    """A forked process has none of the threads that were reading ahead: nothing to wait for."""
    for ahead in list(_LIVE):
        ahead.made.clear()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def forecast(loader, epoch: int):
    """The index lists of the pass after one at `epoch`, if it can be drawn without touching
    the loader's sampler or any random generator; else None."""
    passes = loader._passes
    if passes.pending is not None or passes.iterable:
        return None
    batches = getattr(loader, "batch_sampler", None)
    if type(batches) is not BatchSampler:
        return None
    sampler = batches.sampler
    if type(sampler) is SequentialSampler:
        foreseen = sampler
    elif type(sampler) is RandomSampler and sampler.generator is not None:
        foreseen = copy.copy(sampler)
        foreseen.generator = torch.Generator().set_state(sampler.generator.get_state())
    elif f"{type(sampler).__module__}.{type(sampler).__qualname__}" in _DEALS:
        foreseen = copy.copy(sampler)
        foreseen.set_epoch(epoch + 1)
    else:
        return None
    ahead = copy.copy(batches)
    ahead.sampler = foreseen
    return iter(ahead)


def read_ahead_key(dataset):
    """The dataset's `read_ahead_key()` (a `ConcatDataset`'s: its parts, by identity, and their
    keys) as a `Key`; None when it has none, when it raises, or when it holds anything but values
    and `ByIdentity` objects (`_plain`)."""
    if isinstance(dataset, ConcatDataset):
        keys = tuple(read_ahead_key(part) for part in dataset.datasets)
        if any(key is None for key in keys):
            return None
        return Key.of((tuple(map(ByIdentity, dataset.datasets)), keys))
    keyed = getattr(dataset, "read_ahead_key", None)
    if not callable(keyed):
        return None
    try:
        key = keyed()
    except Exception:  # noqa: BLE001 - no read-ahead; its batches are made in their epoch, as without a key
        return None
    if not _plain(key):
        return None
    return Key.of(key)


class ByIdentity:
    """An object a key names by identity (a cache attached: a new one never compares equal; one
    changed in place is not seen). Kept alive by the key, so that no other object takes its id,
    which a forked child shares."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj


@dataclass(frozen=True, eq=False)
class Key:
    """A `read_ahead_key()` (`raw`) as values (`token`), compared by them: dataclasses by their
    fields (a change in place is seen), NaN equal to NaN, `ByIdentity` objects by their id."""

    raw: Any
    token: Any
    __hash__ = None

    @classmethod
    def of(cls, raw) -> Key:
        return cls(raw, _token(raw))

    def __eq__(self, other) -> bool:
        return isinstance(other, Key) and self.token == other.token


_VALUES = (bool, int, float, complex, str, bytes, type(None), enum.Enum, PurePath)


def _token(key):
    if isinstance(key, Key):
        return key.token
    if isinstance(key, ByIdentity):
        return ("id", id(key.obj))
    if isinstance(key, float) and math.isnan(key):
        return ("nan",)
    if isinstance(key, PurePath):
        return ("path", os.fspath(key))
    if isinstance(key, np.generic):
        return _token(key.item())
    if isinstance(key, _VALUES):
        return key
    if isinstance(key, tuple):
        return tuple(_token(part) for part in key)
    if isinstance(key, frozenset):
        return ("frozenset", frozenset(_token(part) for part in key))
    if isinstance(key, type):
        return ("type", key.__module__, key.__qualname__)
    return (
        type(key).__qualname__,
        tuple(_token(getattr(key, f.name)) for f in dataclasses.fields(key)),
    )


def settle_reads_ahead() -> None:
    """Waits for the next epoch's batches that threads of this process are making, every
    loader's: a fork (a child of `IsolatedLoader`, DataLoader's workers) must not copy a lock one
    of them holds in a read (a file's, h5py's, OpenCV's). A read within an epoch is the loop's
    own, as it was before reads ahead existed."""
    running = {
        made.ahead.future
        for ahead in list(_LIVE)
        for made in list(ahead.made)
        if isinstance(made.ahead.future, Future)
    }
    # a future cancelled in a pool shut down is never "done" for wait(): left out each round
    while running:
        running = {
            future for future in wait(running, timeout=0.1).not_done if not future.cancelled()
        }


def _plain(key) -> bool:
    """Values only, at any depth of tuples, frozensets and dataclasses: numbers, strings, bytes,
    None, enums, paths, types, numpy scalars, `Key` and `ByIdentity` objects. Anything else (a
    list, a dict, a deque, an array, a tensor, any other object) could change in place unseen."""
    if isinstance(key, (Key, ByIdentity, type, np.generic, *_VALUES)):
        return True
    if isinstance(key, (tuple, frozenset)):
        return all(_plain(part) for part in key)
    if dataclasses.is_dataclass(key):
        return all(_plain(getattr(key, f.name)) for f in dataclasses.fields(key))
    return False


def dataset_fingerprint(dataset, depth: int = 2) -> tuple:
    """What the child saw of `dataset` when it was forked: its attributes, by value when they
    are plain (numbers, strings, tuples of them), else by identity (a cache attached or
    replaced, a new index array); a `ConcatDataset`'s parts likewise. An in-place change of
    an array or a nested object is not seen: set the attribute anew, or close the loader."""
    plain = (int, float, str, bool, bytes, type(None))
    items = []
    for key, value in sorted(getattr(dataset, "__dict__", {}).items()):
        if isinstance(value, plain) or (
            isinstance(value, tuple) and all(isinstance(v, plain) for v in value)
        ):
            items.append((key, value))
        elif (
            depth
            and isinstance(value, (list, tuple))
            and value
            and all(hasattr(v, "__dict__") for v in value)
        ):
            items.append((key, tuple(dataset_fingerprint(v, depth - 1) for v in value)))
        else:
            items.append((key, id(value)))
    return (type(dataset).__name__, id(dataset), tuple(items))
