"""ThreadLoader: batches of a memory-speed cache read by threads of the training process.

Use when: a dataset serves items from a decoded or tokenized cache (a `preadv` and a `memcpy`
per item, a resize for a train crop), work that releases the GIL. A DataLoader worker process
would then spend more on the hand-over than on the work: each batch crosses through a fresh
shared-memory segment (created and faulted in by the worker, mapped and faulted in again by
the main process: about 100-150 us per 224 px image on 2 cores) and is pickled. Here threads
of the main process fill each batch straight into its own tensor, batches are yielded in
order, and the loader's state is `StatefulLoader`'s: it resumes exactly, in any epoch.
Cost: per batch one call of the dataset's `read_batch(indices, rng)` in a pool thread; the
order comes from the sampler in the main process, as in a DataLoader without workers.
Adapt here: `threads` (the CPUs of this rank by default), `prefetch` (batches in flight, also
across an epoch's end: `epoch_read_ahead.py`).
Trade-off: only as fast as the dataset's `read_batch` releases the GIL (numpy reads, OpenCV
resizes and torch copies do); Python per-item work belongs in worker processes
(`make_loader(..., path="workers")`): see NOTE [the GIL and the thread paths] (loader_path.py).

A dataset opts in by implementing `ThreadBatched` (`loader_contract.py`): `thread_batches()`
says whether its items are memory-speed reads now (a cache attached). A pool thread then makes
each batch: `collate_fn(items)` with a collate function, else the dataset's `read_batch(indices,
rng)`, which returns the collated batch with its random draws (crops, flips) from `rng`, a
generator seeded by `(seed, epoch, batch position)`: the same batch gets the same crops
whatever the threads and after a resume. With `pin_memory` on CUDA, a `read_batch` that takes
`pin_memory=` fills its batch in page-locked memory from torch's caching host allocator (reused
blocks, no second copy); other batches are copied into pinned memory.
Copy with: common/loader_warning.py, common/loading/epoch_read_ahead.py,
  common/loading/loader_path.py, common/loading/stateful_loader.py, common/resume/batch_seeds.py,
  common/resume/dataset_state.py, common/resume/elastic_rest.py, common/resume/loader_contract.py,
  common/resume/loader_counting.py, common/resume/loader_passes.py, common/resume/loader_resume.py,
  common/resume/loader_state.py, common/resume/order_sources.py, common/resume/pass_sampler.py,
  common/resume/state_keys.py, common/resume/state_records.py, common/sizing/resources.py,
  common/sizing/sizing.py, common/workers/start_watch.py.
"""

from __future__ import annotations

import bisect
import collections
import inspect
import os
import sys
import weakref
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset

from recipes.common.loading.epoch_read_ahead import NextEpoch, forecast, read_ahead_key
from recipes.common.loading.loader_path import thread_capable
from recipes.common.loading.stateful_loader import StatefulLoader
from recipes.common.resume.loader_contract import ReadAheadAware
from recipes.common.resume.loader_counting import Counting, LoaderClosedError

_UNREAD = object()
_ACCEPTED = {
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "drop_last",
    "generator",
    "pin_memory",
    "collate_fn",
}


class ThreadLoader(StatefulLoader):
    """A `StatefulLoader` whose batches are read by a thread pool instead of worker processes.

    Args:
        dataset: a map-style dataset implementing `ThreadBatched`.
        threads: pool threads; the CPUs this process may use when None.
        prefetch: batches in flight ahead of the loop; `2 * threads` when None. At an epoch's
            end they are the next epoch's first, when its order can be known
            (`epoch_read_ahead.py`).
        seed: seeds each batch's random draws with `(seed, epoch, position)`; drawn from
            torch's random generator when None (so `torch.manual_seed` reproduces runs).
        **kwargs: `batch_size`, `shuffle`, `sampler`, `batch_sampler`, `drop_last`,
            `generator`, `pin_memory`, as for a DataLoader.

    Raises:
        TypeError: a dataset without `read_batch`, an iterable dataset, or a DataLoader
            argument that belongs to worker processes (`num_workers`, `collate_fn`, ...).
    """

    def __init__(
        self,
        dataset,
        *,
        threads: int | None = None,
        prefetch: int | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ):
        if thread_capable(dataset) is None:
            raise TypeError(
                "ThreadLoader reads a map-style dataset that says its batches are memory-speed "
                "reads (thread_batches(), loader_contract.ThreadBatched); "
                f"{type(dataset).__name__} has none. Use make_loader(..., path='workers')."
            )
        unknown = sorted(set(kwargs) - _ACCEPTED)
        if unknown:
            raise TypeError(
                f"ThreadLoader does not take {unknown}: they configure worker processes or a "
                "collate function, and batches are made by threads of this process. Use "
                "make_loader(..., path='workers') for them."
            )
        if threads is None:
            threads = _usable_cpus()
        if threads < 1 or (prefetch is not None and prefetch < 1):
            raise ValueError(
                f"`threads` and `prefetch` must be positive, but are {threads!r}, {prefetch!r} "
                "instead."
            )
        self.pin = bool(kwargs.pop("pin_memory", False)) and torch.cuda.is_available()
        collate = kwargs.get("collate_fn")
        # read_batch makes whole batches (crops drawn from the batch's rng); a collate function
        # of the user's gets the items instead (read_items(indices, rng) when the dataset has it:
        # the same draws), unless it is the one read_batch equals
        self._whole = hasattr(dataset, "read_batch") and (
            collate is None or collate is getattr(dataset, "read_batch_collate", None)
        )
        # a read_batch that takes `pin_memory` fills its batch in pinned memory itself (no copy)
        self._pins_itself = (
            self._whole and "pin_memory" in inspect.signature(dataset.read_batch).parameters
        )
        super().__init__(dataset, num_workers=0, **kwargs)
        self.threads = threads
        self.prefetch = prefetch or 2 * threads
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        self.seed = int(seed)
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: NextEpoch | None = (
            None  # the next epoch's first batches, asked at this one's end
        )
        self._passes_read = _PassesRead()
        for holder in (self.batch_sampler, self.sampler):
            if isinstance(holder, ReadAheadAware):
                holder.note_read_ahead(self.prefetch)

    def __iter__(self):
        return Counting(
            self._passes, *self._begin_pass(), restart=weakref.WeakMethod(self._begin_pass)
        )

    def _begin_pass(self):
        current = self._passes.start(0)
        self._in_process_pool()
        return current, _Batches(self, iter(self._index_sampler), current)

    def _in_process_pool(self) -> None:
        if not isinstance(self._pool, ThreadPoolExecutor):
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ThreadLoader")

    def state_dict(self) -> dict[str, Any]:
        """`StatefulLoader.state_dict()`, and the seed of the batches' random draws (crops and
        flips), so that a resumed loader draws what this one would have."""
        state = super().state_dict()
        state["thread_seed"] = self.seed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`StatefulLoader.load_state_dict()`; a state saved on the thread path also restores
        the seed of the random draws (a worker-path state leaves this loader's)."""
        super().load_state_dict(state)
        if state.get("thread_seed") is not None:
            self.seed = int(state["thread_seed"])

    def _read(self, indices: list[int], epoch: int, position: int, seed: int | None = None):
        if seed is None:
            seed = self.seed
        rng = np.random.default_rng([seed, epoch, position])
        if self._whole:
            if self._pins_itself:
                return self.dataset.read_batch(indices, rng, pin_memory=self.pin)
            batch = self.dataset.read_batch(indices, rng)
        else:
            if isinstance(self.dataset, ConcatDataset):  # a mixture's sources: each part's items
                items = _concat_items(self.dataset, indices, rng)
            elif hasattr(
                self.dataset, "read_items"
            ):  # the dataset's items, drawn from the batch's rng
                items = self.dataset.read_items(indices, rng)
            else:
                items = _items(self.dataset, indices)
            batch = self.collate_fn(items)
        if self.pin:
            return _pinned(batch)
        return batch

    @property
    def read_ahead_threads(self) -> int:
        """The pool's threads (LoaderMonitor's advice names the thread path by it)."""
        return self.threads

    def close(self) -> None:
        """Ends the pool's threads; the next `iter` starts new ones. Also `with loader:`. An
        epoch's iterator in use then raises `LoaderClosedError`; the state stays where it was."""
        current = self._passes.current
        if current is not None and not current.done:
            current.closed = True
        ahead = self._ahead
        self._ahead = None
        if ahead is not None:
            ahead.cancel()
        pool = self._pool
        self._pool = None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if (
            pool is None or sys is None or sys.is_finalizing()
        ):  # at exit its threads are being joined anyway
            return
        try:
            pool.shutdown(wait=False, cancel_futures=True)
        except Exception:  # noqa: BLE001 - a finalizer must not raise (half torn-down modules)
            pass


class _Batches:
    """The pass's batches in order, `prefetch` of them read ahead by the pool. The epoch and
    the first position are read from the pass when the first indices are drawn (a `set_epoch`
    between `iter()` and the first batch moves the pass to that epoch)."""

    def __init__(self, loader: ThreadLoader, indices, current):
        self._loader = loader
        self._indices = indices
        self._pass = current
        self._position: int | None = None  # batches of the epoch before the first one read here
        self._pending: collections.deque = collections.deque()
        self._ended = False
        self._next: NextEpoch | None = (
            None  # the next epoch's batches this pass asked for at its end
        )
        self._key = _UNREAD  # the dataset's read_ahead_key as this pass began, read once
        seen = loader._passes_read
        if seen.last is not current:  # a pass, not a restart of one (RobustLoader)
            seen.last = current
            seen.count += 1

    def _fill(self) -> None:
        loader = self._loader
        if loader._pool is None:
            raise LoaderClosedError(
                "this ThreadLoader was closed while its epoch was running; start a new epoch with "
                "iter(loader) (or load a saved state_dict() to continue where the loop was)."
            )
        while not self._ended and len(self._pending) < loader.prefetch:
            indices = next(self._indices, None)
            if indices is None:
                self._ended = True
                break
            if self._position is None:
                # the first draw settled the epoch and where it starts: the batches skipped, or the
                # position a resumed sampler starts at by itself (LengthBucketSampler, elastic ones)
                self._position = self._pass.position
            indices = [int(i) for i in indices]
            self._pending.append(
                self._made_ahead(indices)
                or loader._pool.submit(loader._read, indices, self._pass.epoch, self._position)
            )
            self._position += 1
        if self._ended:
            self._read_ahead()

    def _made_ahead(self, indices: list[int]):
        """This draw's batch if the last pass made it ahead (the same indices, epoch, position,
        seed, pool and dataset); the first that differs drops what was made ahead."""
        loader = self._loader
        ahead = loader._ahead
        if ahead is None or ahead is self._next:
            return None
        if self._key is _UNREAD:
            self._key = read_ahead_key(loader.dataset)
        future = ahead.take(loader, indices, self._pass.epoch, self._position, self._key)
        if future is None:
            loader._ahead = None
        return future

    def _read_ahead(self) -> None:
        """Every index of the epoch asked for: the pool's room goes to the next epoch's first
        batches."""
        loader = self._loader
        if self._next is None:
            if loader._ahead is not None:
                loader._ahead.cancel()
            # from the second pass on: a loader iterated once (an evaluation) makes nothing it does
            # not use
            key = None
            batches = None
            if loader._passes_read.count >= 2:
                key = read_ahead_key(loader.dataset)
            if key is not None:
                batches = forecast(loader, self._pass.epoch)
            if batches is None:
                loader._ahead = None
                self._next = NextEpoch(None, self._pass.epoch, iter(()), loader.seed, None)
                return
            self._next = loader._ahead = NextEpoch(
                loader._pool, self._pass.epoch, batches, loader.seed, key
            )
        if loader._ahead is self._next and self._next.pool is loader._pool:
            self._next.extend(loader, loader.prefetch - len(self._pending) - len(self._next.made))

    def __iter__(self):
        return self

    def __next__(self):
        self._fill()
        if not self._pending:
            raise StopIteration
        future = self._pending.popleft()
        try:
            return future.result()
        except Exception:
            raise  # its position is used up (loader_passes: the dataset's error)
        except BaseException:
            self._pending.appendleft(future)  # interrupted: the batch is still the next one
            raise

    def failed_batches_are_used(self, error: BaseException) -> bool:
        """An error from a pool thread is the dataset's: that batch's position is behind the loop
        (not when the loader was closed under the loop: those batches were never made)."""
        return not isinstance(error, (LoaderClosedError, CancelledError)) and not getattr(
            error, "batch_not_made", False
        )

    def __len__(self) -> int:
        return len(self._loader._index_sampler)

    def __del__(self):
        for future in self._pending:
            future.cancel()


@dataclass
class _PassesRead:
    """The last pass whose batches were asked for (`last`), and how many passes were (`count`)."""

    last: object = None
    count: int = 0


def _usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _items(dataset, indices: list[int]) -> list:
    """`dataset`'s items at `indices`: `__getitems__` when it has one, else one by one."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return getitems(indices)
    return [dataset[i] for i in indices]


def _concat_items(dataset: ConcatDataset, indices: list[int], rng) -> list:
    """The items of `indices` of a `ConcatDataset`, each part read at once (`read_items` with
    the batch's generator when it has one, else `__getitems__` or item by item), in order."""
    by_part: dict[int, list[tuple[int, int]]] = {}
    for position, index in enumerate(indices):
        part = bisect.bisect_right(dataset.cumulative_sizes, index)
        local = index
        if part:
            local -= dataset.cumulative_sizes[part - 1]
        by_part.setdefault(part, []).append((position, local))
    items: list = [None] * len(indices)
    for part, pairs in by_part.items():
        source = dataset.datasets[part]
        local = [i for _, i in pairs]
        if hasattr(source, "read_items"):
            got = source.read_items(local, rng)
        elif hasattr(source, "__getitems__"):
            got = source.__getitems__(local)
        else:
            got = [source[i] for i in local]
        for (position, _), item in zip(pairs, got, strict=True):
            items[position] = item
    return items


def _pinned(batch):
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, (tuple, list)):
        return type(batch)(_pinned(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _pinned(v) for k, v in batch.items()}
    return batch
