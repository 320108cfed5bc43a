"""StatefulLoader: a DataLoader whose `state_dict()` resumes exactly, in any epoch, at any point.

Use when: you checkpoint a training run and must resume it without losing or repeating a
sample: mid-epoch, at an epoch boundary, in any epoch, with workers persistent or not.
Cost: one counter increment per batch; one capture of the sampler's random state per epoch
(5 KB per `torch.Generator`); on resume, the skipped batches' indices are drawn and dropped
(map-style: no data is loaded for them) or, for an iterable dataset with `resume_after`
(`ShardedIterableDataset`), each worker starts at its own position.
Adapt here: nothing; what a sampler or dataset implements to be resumed is written down in
`loader_contract.py`, with what this loader guarantees in return.
Trade-off: the loader hooks DataLoader in one place, its `_index_sampler` property (what
DataLoader's iterators iterate, read once per iterator and iterated once per epoch); that is
where an epoch's order is drawn, whatever the worker persistence, so that is where the state
is captured. `tests/common/test_exactly_once.py` fails if a torch release moves it.

Why the draw, not `__iter__`: with `persistent_workers=True` DataLoader draws its workers' base
seed (from `generator=`) once, not every epoch, so the random state at `__iter__` is not the one
the order comes from; a resumed loader draws that seed again. The loader's default shuffle
gets a generator of its own for the order (`RandomSampler(generator=...)`), never shared with
the base seed, so the order does not depend on the workers.

The state is plain JSON: `{"version", "epoch", "batches_yielded", "order", "plan", ...}`:
`order` is the random state the epoch's order was drawn from, `plan` the settings that shape it
(checked on load); `"sampler"` (a `PositionedBatchSampler`'s global position) and
`"world_size"` (an iterable dataset's ranks) make a resume elastic, from N ranks to M.
"""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from recipes.common.loader_contract import (
    EpochSeeded,
    Prefetching,
    ReadAheadAware,
    ResumableIterable,
    StatefulSampler,
)
from recipes.common.loader_state import (
    GlobalDraws,
    capture,
    differences,
    find_generators,
    plan_settings,
    restore,
)
from recipes.common.loader_warning import LoaderWarning

STATE_VERSION = 2


class StatefulLoader(DataLoader):
    """A `DataLoader` with `state_dict()` / `load_state_dict()` that resume exactly.

    Takes DataLoader's arguments. With `shuffle=True` the order comes from a generator of the
    loader's own, seeded from `generator` when given, else from torch's random generator (so
    `torch.manual_seed` reproduces runs); a state carries it, so a resumed process need not seed.

    Example:
        >>> loader = make_loader(dataset, batch_size=32, shuffle=True)   # a StatefulLoader
        >>> for epoch in range(3):
        ...     for step, batch in enumerate(loader):
        ...         if step == 100:
        ...             torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")
        >>> loader.load_state_dict(torch.load("ckpt.pt")["loader"])  # in the new process
        >>> for batch in loader: ...                                 # batch 101 onwards
    """

    def __init__(self, dataset, **kwargs: Any):
        if kwargs.get("shuffle") and not isinstance(dataset, IterableDataset) and kwargs.get("sampler") is None \
                and kwargs.get("batch_sampler") is None:
            kwargs["shuffle"] = False
            kwargs["sampler"] = RandomSampler(dataset, generator=_order_generator(kwargs.get("generator")))
        super().__init__(dataset, **kwargs)
        self._passes = _Passes(self)
        if self.num_workers:  # a sampler's own count now runs ahead of the loop: let it say so
            for holder in (self.batch_sampler, self.sampler):
                if isinstance(holder, ReadAheadAware):
                    holder.note_read_ahead(self.num_workers * (self.prefetch_factor or 2))

    # The one hook into DataLoader's internals (see the module doc). The wrapper holds the
    # pass tracker, never the loader: a loader -> iterator -> loader cycle would keep
    # persistent workers alive until a garbage collection, which may run in a forked child.
    @property
    def _index_sampler(self):
        return _PassSampler(super()._index_sampler, self._passes)

    def __iter__(self):
        current = self._passes.start(self.num_workers)
        iterable = isinstance(self.dataset, IterableDataset)
        if iterable:
            current.drawn = True  # nothing to draw: the order is the dataset's (epoch, rank, worker)
        if iterable and (current.skip or (current.resumed or {}).get("replayed")):
            inner = _resumed_iterable(self, current)
        else:
            if current.resumed is None and isinstance(self.dataset, Prefetching):
                self.dataset.start_downloads(num_workers=max(1, self.num_workers))  # before the workers fork
            inner = super().__iter__()
        _track(inner)
        return _Counting(self._passes, current, inner)

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is, as plain JSON: the epoch, the batches of it the loop received, the
        random state its order was drawn from, and the settings that shape it (see the module
        doc and `loader_contract.py` for what a state saved at each point resumes)."""
        state = self._passes.state()
        state["plan"] = self._plan()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at the first batch not received when `state` was saved (on the next `iter`).

        An epoch-seeded sampler (or dataset) is set to the saved epoch now; calling its
        `set_epoch` with another epoch before iterating starts that epoch afresh instead.

        Raises:
            ValueError: not a loader state of this version, or one saved under other settings.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "batches_yielded" not in state:
            older = isinstance(state, dict) and state.get("version") == 1
            raise ValueError(f"not a StatefulLoader state (version {STATE_VERSION}): {state!r:.200}"
                             + ("; version 1 states (recipes 0.1) resumed exactly only in a first epoch without "
                                "persistent workers: resume from a checkpoint saved by this version" if older else ""))
        saved, mine = state.get("plan") or {}, self._plan()
        diff = differences(saved, mine)
        if diff:
            raise ValueError("This loader state was saved under other settings than this loader's, and they decide "
                             "which samples each batch holds: " + "; ".join(diff) + ". Build the loader as the run "
                             "that saved it did.")
        self._passes.load(state)

    def _plan(self) -> dict[str, Any]:
        plan: dict[str, Any] = {"batch_size": self.batch_size, "drop_last": self.drop_last}
        if isinstance(self.dataset, IterableDataset):
            plan["dataset"] = plan_settings(self.dataset)
            return plan
        plan["num_samples"] = len(self.dataset)
        if self.batch_size is None and self.batch_sampler is not None:  # the user's batch sampler
            plan["batch_sampler"] = plan_settings(self.batch_sampler)
        else:
            plan["sampler"] = plan_settings(self.sampler)
        return plan


def _order_generator(seeded_from: torch.Generator | None) -> torch.Generator:
    """The order's own generator: seeded from the user's `generator`, else from torch's RNG."""
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=seeded_from).item())
    return torch.Generator().manual_seed(seed)


@dataclass
class _Pass:
    """One iteration over the loader: its epoch and where it stands."""

    epoch: int
    skip: int  # batches of the epoch skipped at its start (a resume), counted in `yielded`
    workers: int  # the worker count whose order this pass follows (an iterable dataset's)
    resumed: dict | None = None  # the loaded state this pass resumes
    yielded: int = 0
    done: bool = False  # StopIteration reached the loop
    drawn: bool = False
    snapshot: dict = field(default_factory=dict)  # the random state the order was drawn from


class _Passes:
    """The loader's passes and a loaded state waiting for the next one. Holds the sampler,
    batch sampler and dataset, never the loader (see `_index_sampler`)."""

    def __init__(self, loader: StatefulLoader):
        self.dataset = loader.dataset
        self.iterable = isinstance(loader.dataset, IterableDataset)
        roles = {"batch_sampler": loader.batch_sampler, "sampler": loader.sampler,
                 "batch_sampler.sampler": getattr(loader.batch_sampler, "sampler", None)}
        self.positioned = loader.batch_sampler if _positioned(loader.batch_sampler) else None
        self.holder = _epoch_holder(loader.dataset, roles)
        self.stateful = {} if self.iterable else {
            name: s for name, s in roles.items()
            if s is not None and s is not self.positioned and isinstance(s, StatefulSampler) and _no_args(s.state_dict)}
        self.generators = {} if self.iterable else find_generators(
            {"sampler": loader.sampler, "batch_sampler": loader.batch_sampler})
        self.blind = None if self.iterable else _blind_spot(roles, self)
        self.watch_global = not self.iterable and self.holder is None and not self.generators and not self.stateful
        self.batch_size, self.drop_last = loader.batch_size, loader.drop_last
        self.current: _Pass | None = None
        self.pending: dict | None = None
        self.warned: set[str] = set()

    # ---- the epoch ---------------------------------------------------------------------
    def _holder_epoch(self) -> int | None:
        return None if self.holder is None else int(self.holder.epoch)

    def start(self, num_workers: int) -> _Pass:
        """Begins a pass: the loaded state's, else a fresh epoch."""
        pending, self.pending = self.pending, None
        if pending is not None and self.holder is not None and self._holder_epoch() != pending["epoch"]:
            pending = None  # set_epoch chose another epoch since the load: it starts afresh
        if pending is not None:
            epoch = pending["epoch"]
        elif self.holder is not None:
            epoch = self._holder_epoch()
        else:  # a loader that counts its epochs: one per pass
            epoch = 0 if self.current is None else self.current.epoch + 1
        skip = 0 if pending is None else int(pending["batches_yielded"])
        if pending is not None and self.positioned is not None and pending.get("sampler") is not None:
            self.positioned.load_state_dict(pending["sampler"])  # it resumes by itself, on any number of ranks
            skip = 0
        saved_workers = None if pending is None else pending.get("num_workers")
        if saved_workers is None or not (skip or pending.get("replayed")):
            saved_workers = num_workers  # nothing received yet: the epoch follows this loader's workers
        workers = int(saved_workers)
        self.current = _Pass(epoch, skip, workers, resumed=pending, yielded=skip)
        return self.current

    def draw(self, current: _Pass) -> None:
        """At the first index of a pass, before the sampler draws: restores the loaded random
        state, then captures the one this order is drawn from."""
        order = (current.resumed or {}).get("order") or {}
        restore(self.generators, order.get("generators", {}))
        for name, state in order.get("samplers", {}).items():
            if name not in self.stateful:
                raise ValueError(f"This loader state holds the state of a stateful {name}, which this loader does "
                                 "not have; build the loader with the same sampler as the run that saved it.")
            self.stateful[name].load_state_dict(state)
        current.snapshot = self._capture()
        current.drawn = True

    def _capture(self) -> dict[str, Any]:
        return {"generators": capture(self.generators),
                "samplers": {name: s.state_dict() for name, s in self.stateful.items()}}

    # ---- state -------------------------------------------------------------------------
    def load(self, state: dict[str, Any]) -> None:
        self.pending = dict(state)
        if self.holder is not None:
            self.holder.set_epoch(int(state["epoch"]))

    def state(self) -> dict[str, Any]:
        self._warn_blind()
        pending = self.pending
        if pending is not None and not (self.holder is not None and self._holder_epoch() != pending["epoch"]):
            return {k: v for k, v in pending.items() if k != "plan"}
        current = self.current
        if current is None or current.done or (self.holder is not None and self._holder_epoch() != current.epoch):
            return self._fresh(current)
        state = {"version": STATE_VERSION, "epoch": current.epoch, "batches_yielded": current.yielded,
                 "num_workers": current.workers,
                 "order": current.snapshot if current.drawn else ((current.resumed or {}).get("order")
                                                                  or self._capture())}
        if self.positioned is not None:
            state["sampler"] = self.positioned.state_dict(batches_done=current.yielded)
        if self.iterable and isinstance(self.dataset, ResumableIterable):
            self._iterable_position(state, current)
        return state

    def _fresh(self, current: _Pass | None) -> dict[str, Any]:
        """The state of a pass not begun: the next epoch after a finished one."""
        if self.holder is not None:
            epoch = self._holder_epoch()
        else:
            epoch = 0 if current is None else current.epoch + (1 if current.done else 0)
        state = {"version": STATE_VERSION, "epoch": epoch, "batches_yielded": 0, "num_workers": None,
                 "order": self._capture()}
        if self.iterable and isinstance(self.dataset, ResumableIterable):
            state["world_size"] = int(self.dataset.world_size)
        return state

    def _iterable_position(self, state: dict[str, Any], current: _Pass) -> None:
        """An iterable dataset's ranks; a pass that replays other ranks' rests (an elastic
        resume) saves where that replay began and how far it got."""
        resumed = current.resumed or {}
        old_world = resumed.get("world_size")
        world = int(self.dataset.world_size)
        state["world_size"] = world
        if old_world is not None and old_world != world:
            state.update(batches_yielded=current.skip, world_size=old_world, replay_world=world,
                         replayed=int(resumed.get("replayed", 0)) + current.yielded - current.skip)
        elif resumed.get("replayed"):
            state.update(batches_yielded=current.skip, world_size=resumed["world_size"],
                         replay_world=resumed["replay_world"],
                         replayed=int(resumed["replayed"]) + current.yielded - current.skip)

    def _warn_blind(self) -> None:
        if self.blind and "blind" not in self.warned:
            self.warned.add("blind")
            warnings.warn(self.blind, LoaderWarning, stacklevel=4)

    def warn_global(self, sampler, which: list[str]) -> None:
        if type(sampler) is BatchSampler:  # name the user's sampler, not torch's batching around it
            sampler = sampler.sampler
        if "global" not in self.warned:
            self.warned.add("global")
            warnings.warn(
                f"{type(sampler).__name__} drew its order from {' and '.join(which)} global random generator, which a "
                "loader state cannot restore (the training step draws from it too): a resumed run would see another "
                "order, repeating and losing samples. Give the sampler a generator of its own (for example "
                "RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))), make it set_epoch-seeded, or "
                "use make_loader(..., shuffle=True).", LoaderWarning, stacklevel=4)


class _PassSampler:
    """The loader's index sampler: at a pass's first index, the random state is restored and
    captured (`_Passes.draw`) and a resume's first batches are skipped (indices only)."""

    def __init__(self, inner, passes: _Passes):
        self.inner, self.passes = inner, passes

    def __iter__(self):  # a generator: nothing runs until DataLoader asks for the first index
        passes, current = self.passes, self.passes.current
        if current is None or current.drawn:  # iterated outside a pass of the loader
            yield from self.inner
            return
        passes.draw(current)
        watch = GlobalDraws() if passes.watch_global else None
        if watch is not None:
            watch.before()
        iterator = iter(self.inner)
        first = next(iterator, _END)
        if watch is not None:
            drawn = watch.after()
            if drawn:
                passes.warn_global(self.inner, drawn)
        skip = current.skip
        while skip and first is not _END:
            first, skip = next(iterator, _END), skip - 1
        if first is _END:
            return
        yield first
        yield from iterator

    def __len__(self) -> int:
        return len(self.inner)


_END = object()


class _Counting:
    """The DataLoader iterator, counting what reaches the loop; other attributes pass through
    (`_workers`, for LoaderMonitor and RobustLoader)."""

    def __init__(self, passes: _Passes, current: _Pass, inner):
        self._passes, self._pass, self._inner = passes, current, inner

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self._inner)
        except StopIteration:
            self._pass.done = True
            raise
        self._pass.yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _epoch_holder(dataset, roles: dict[str, Any]):
    """What carries the epoch: an iterable dataset, the batch sampler, or the sampler."""
    candidates = [dataset] if isinstance(dataset, IterableDataset) else list(roles.values())
    for holder in candidates:
        if holder is not None and isinstance(holder, EpochSeeded):
            return holder
    return None


def _positioned(batch_sampler) -> bool:
    """A `PositionedBatchSampler`: `state_dict` takes the loop's count (`batches_done=`)."""
    if batch_sampler is None or not (hasattr(batch_sampler, "state_dict") and hasattr(batch_sampler, "load_state_dict")):
        return False
    try:
        return "batches_done" in inspect.signature(batch_sampler.state_dict).parameters
    except (TypeError, ValueError):
        return False


def _no_args(method) -> bool:
    try:
        return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return False


_DETERMINISTIC = (SequentialSampler, range, list, tuple)


def _blind_spot(roles: dict[str, Any], passes: _Passes) -> str | None:
    """A warning for a sampler whose random state the loader cannot see, or None."""
    if passes.holder is not None or passes.positioned is not None or passes.generators or passes.stateful:
        return None
    for name, sampler in roles.items():
        if sampler is None or isinstance(sampler, _DETERMINISTIC) or type(sampler) is BatchSampler:
            continue
        half = " It has set_epoch() but no `epoch` attribute: set self.epoch in set_epoch." \
            if hasattr(sampler, "set_epoch") else ""
        return (f"loader.state_dict() cannot see the random state of the {name} {type(sampler).__name__}: it holds no "
                "random generator as an attribute, has no set_epoch()/epoch and no state_dict()." + half +
                " If its order is random, a resume will not reproduce it. Give it a torch.Generator attribute, a "
                "(seed, epoch)-seeded order with set_epoch(), or state_dict()/load_state_dict() (see "
                "recipes.common.loader_contract).")
    return None


# ---- fork safety ---------------------------------------------------------------------------
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _track(iterator) -> None:
    if hasattr(iterator, "_workers"):
        _LIVE.add(iterator)


def _disown_in_child() -> None:
    """A forked child (another loader's worker) inherits this process's loader iterators; if one
    is finalised there, it would shut down the parent's workers ("can only test a child
    process"). Marked as shut down, they are inert in the child."""
    for iterator in list(_LIVE):
        iterator._shutdown = True


os.register_at_fork(after_in_child=_disown_in_child)


def _resumed_iterable(loader: StatefulLoader, current: _Pass):
    """An iterator over the rest of an iterable dataset's epoch, after `current.skip` batches."""
    dataset, skip, state = loader.dataset, current.skip, current.resumed or {}
    if not isinstance(dataset, ResumableIterable):
        warnings.warn(f"{type(dataset).__name__} has no resume_after(); reading and discarding the first {skip} "
                      "batches of the epoch to resume.", LoaderWarning, stacklevel=3)
        return _dropped(DataLoader.__iter__(loader), skip)
    before, world = current.workers, state.get("world_size")
    whole = loader.collate_fn if loader.batch_size is not None else None
    if world is not None and world != dataset.world_size:  # other ranks: replay their rests here
        replay = state.get("replay_world")
        if state.get("replayed") and replay != dataset.world_size:
            raise ValueError(f"This state was saved while {replay} rank(s) replayed the rest of an epoch begun on "
                             f"{world}; resume it on {replay} rank(s), or from a state saved in another epoch.")
        rest = dataset.resume_after(skip, batch_size=loader.batch_size, drop_last=loader.drop_last,
                                    num_workers=before, interleave=True, world_size=world)
        iterator = iter(DataLoader(rest, batch_size=None, collate_fn=whole, pin_memory=loader.pin_memory))
        return _dropped(iterator, int(state.get("replayed", 0)))
    if before != loader.num_workers:  # the epoch began with other workers: replay its order in-process
        rest = dataset.resume_after(skip, batch_size=loader.batch_size, drop_last=loader.drop_last,
                                    num_workers=before, interleave=True)
        return iter(DataLoader(rest, batch_size=None, collate_fn=whole, pin_memory=loader.pin_memory))
    rest = dataset.resume_after(skip, batch_size=loader.batch_size, drop_last=loader.drop_last,
                                num_workers=loader.num_workers)
    kwargs = dict(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                  worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context)
    if loader.num_workers:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return iter(DataLoader(rest, **kwargs))  # one epoch on fresh workers, then the loader's own again


def _dropped(iterator, count: int):
    """`iterator` after its first `count` items (read and discarded)."""
    for _ in range(count):
        if next(iterator, _END) is _END:
            break
    return iterator
