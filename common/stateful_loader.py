"""StatefulLoader: a DataLoader whose `state_dict()` counts the batches your loop received.

Use when: you checkpoint mid-epoch. A sampler's own count runs ahead of training by up to
`num_workers x prefetch_factor` batches (the workers have been handed them), so resuming
from it silently drops those batches. This loader counts batches as they are *yielded to
the loop*, like torchdata's `StatefulDataLoader`, and resumes at the first one not yielded.
Cost: one counter increment per batch; on resume, the skipped batches' indices are drawn and
dropped (map-style: no data is loaded for them) or, for an iterable dataset with
`resume_after` (`ShardedIterableDataset`), each worker starts at its own position.
Adapt here: an iterable dataset of yours implements `resume_after(batches_done, *, batch_size,
drop_last, num_workers) -> dataset` to resume without reading what it skips.
Trade-off: the order must be reproducible: samplers with `set_epoch` (DistributedSampler,
LengthBucketSampler) are; `shuffle=True` gets a seeded generator from `make_loader`, whose
state at the start of the epoch is saved. An iterable dataset without `resume_after` is read
and discarded up to the resume point.

The state is plain JSON: `{"version", "batches_yielded", "epoch_rng", "sampler_epoch",
"num_workers"}`, plus `"sampler"` (a `LengthBucketSampler`'s global position) and `"world_size"`
(an iterable dataset's ranks) where they apply: these two make a resume elastic, from N ranks
to M.
"""

from __future__ import annotations

import base64
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

STATE_VERSION = 1


class StatefulLoader(DataLoader):
    """A `DataLoader` with `state_dict()` / `load_state_dict()` that resume exactly.

    Example:
        >>> loader = make_loader(dataset, batch_size=32, shuffle=True)   # a StatefulLoader
        >>> for step, batch in enumerate(loader):
        ...     if step == 100:
        ...         torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")
        >>> loader.load_state_dict(torch.load("ckpt.pt")["loader"])  # in the new process
        >>> for batch in loader: ...                                 # batch 101 onwards
    """

    def __init__(self, dataset, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        if self.num_workers:  # a sampler's own count now runs ahead of the loop: let it say so
            for holder in (self.batch_sampler, self.sampler):
                if holder is not None and hasattr(holder, "state_dict"):
                    holder._read_ahead_by = self.num_workers * (self.prefetch_factor or 2)
        self._yielded = 0
        self._skip_next = 0
        self._epoch_rng: str | None = None
        self._resume_rng: str | None = None
        self._skip_workers: int | None = None  # the worker count of the interrupted epoch
        self._skip_world: int | None = None  # its number of ranks

    # DataLoader's iterators read `_index_sampler` once, and again on each persistent reset.
    @property
    def _index_sampler(self):
        return _SkipFirst(super()._index_sampler, self)

    def __iter__(self):
        skip, self._skip_next = self._skip_next, 0
        if self.generator is not None:
            if self._resume_rng is not None:
                self.generator.set_state(_decode(self._resume_rng))
                self._resume_rng = None
            self._epoch_rng = _encode(self.generator.get_state())
        self._yielded = skip
        if skip and isinstance(self.dataset, IterableDataset):
            return _Counting(self, _resumed_iterable(self, skip))
        self._pending_index_skip = skip
        start = getattr(self.dataset, "start_downloads", None)
        if not skip and callable(start):  # a PrefetchCache's first shards, before workers start
            start(num_workers=max(1, self.num_workers))
        return _Counting(self, super().__iter__())

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: batches yielded in the current epoch (JSON-serialisable).

        With a batch sampler that keeps its own global position (`LengthBucketSampler`), its
        state for the batches the loop received is included, and resuming goes through it:
        on another number of ranks too. An iterable dataset's `world_size` is recorded, so a
        `ShardedIterableDataset` resumes on another number of ranks as well.
        """
        epoch = getattr(self._epoch_holder(), "epoch", None)
        state = {"version": STATE_VERSION, "batches_yielded": int(self._yielded), "epoch_rng": self._epoch_rng,
                 "sampler_epoch": None if epoch is None else int(epoch), "num_workers": int(self.num_workers)}
        sampler = self._positioned_sampler()
        if sampler is not None:
            state["sampler"] = sampler.state_dict(batches_done=int(self._yielded))
        if isinstance(self.dataset, IterableDataset) and getattr(self.dataset, "world_size", None) is not None:
            state["world_size"] = int(self.dataset.world_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at the first batch not yielded when `state` was taken (on the next `iter`).

        Raises:
            ValueError: a state of another version or without the loader's fields.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "batches_yielded" not in state:
            raise ValueError(f"not a StatefulLoader state (version {STATE_VERSION}): {state!r:.200}")
        holder = self._epoch_holder()
        if state.get("sampler_epoch") is not None and hasattr(holder, "set_epoch"):
            holder.set_epoch(int(state["sampler_epoch"]))
        self._resume_rng = state.get("epoch_rng") if self.generator is not None else None
        self._skip_next = int(state["batches_yielded"])
        sampler = self._positioned_sampler()
        if sampler is not None and state.get("sampler") is not None:
            sampler.load_state_dict(state["sampler"])  # the sampler resumes, on any number of ranks
            self._skip_next = 0
        self._yielded = self._skip_next
        self._skip_workers = state.get("num_workers")
        self._skip_world = state.get("world_size")

    def _positioned_sampler(self):
        """The batch sampler, when it saves its own global position (`state_dict(batches_done=)`)."""
        import inspect

        holder = self.batch_sampler
        if not (hasattr(holder, "state_dict") and hasattr(holder, "load_state_dict")):
            return None
        try:
            return holder if "batches_done" in inspect.signature(holder.state_dict).parameters else None
        except (TypeError, ValueError):
            return None

    def _epoch_holder(self):
        """What carries the epoch: the batch sampler, the sampler, or an iterable dataset."""
        if isinstance(self.dataset, IterableDataset):
            return self.dataset
        for holder in (self.batch_sampler, self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if holder is not None and hasattr(holder, "set_epoch"):
                return holder
        return None


class _SkipFirst:
    """The loader's index sampler, dropping the first `_pending_index_skip` batches once."""

    def __init__(self, inner, loader: StatefulLoader):
        self.inner, self.loader = inner, loader

    def __iter__(self):
        skip = getattr(self.loader, "_pending_index_skip", 0)
        self.loader._pending_index_skip = 0
        iterator = iter(self.inner)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                return
        yield from iterator

    def __len__(self) -> int:
        return len(self.inner)


_END = object()


class _Counting:
    """The DataLoader iterator, counting what reaches the loop; other attributes pass through
    (`_workers`, for LoaderMonitor)."""

    def __init__(self, loader: StatefulLoader, inner):
        self._loader, self._inner = loader, inner

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._inner)
        self._loader._yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _resumed_iterable(loader: StatefulLoader, skip: int):
    """An iterator over the rest of an iterable dataset's epoch, after `skip` batches."""
    dataset = loader.dataset
    resume = getattr(dataset, "resume_after", None)
    if resume is None:
        warnings.warn(f"{type(dataset).__name__} has no resume_after(); reading and discarding the first {skip} "
                      "batches of the epoch to resume.", stacklevel=3)
        iterator = DataLoader.__iter__(loader)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                break
        return iterator
    before = loader._skip_workers if loader._skip_workers is not None else loader.num_workers
    world = loader._skip_world
    loader._skip_workers = loader._skip_world = None
    if world is not None and world != getattr(dataset, "world_size", world):  # other ranks: replay here
        rest = resume(skip, batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=before,
                      interleave=True, world_size=world)
        whole = loader.collate_fn if loader.batch_size is not None else None
        return iter(DataLoader(rest, batch_size=None, collate_fn=whole, pin_memory=loader.pin_memory))
    if before != loader.num_workers:  # the epoch began with other workers: replay its order in-process
        rest = resume(skip, batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=before,
                      interleave=True)
        whole = loader.collate_fn if loader.batch_size is not None else None
        return iter(DataLoader(rest, batch_size=None, collate_fn=whole, pin_memory=loader.pin_memory))
    rest = resume(skip, batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers)
    kwargs = dict(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                  worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context)
    if loader.num_workers:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return iter(DataLoader(rest, **kwargs))  # one epoch on fresh workers, then the loader's own again


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
