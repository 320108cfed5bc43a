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
is captured. `tests/common/resume/test_exactly_once.py` fails if a torch release moves it.

Why the draw, not `__iter__`: with `persistent_workers=True` DataLoader draws its workers' base
seed (from `generator=`) once, not every epoch, so the random state at `__iter__` is not the one
the order comes from; a resumed loader draws that seed again. The loader's default shuffle
gets a generator of its own for the order (`RandomSampler(generator=...)`), never shared with
the base seed, so the order does not depend on the workers.

The state is plain JSON: `{"version", "epoch", "batches_yielded", "order", "plan", ...}`:
`order` is the random state the epoch's order was drawn from, `plan` the settings that shape it
(checked on load); `"sampler"` (a `PositionedBatchSampler`'s global position) and
`"world_size"` (an iterable dataset's ranks) make a resume elastic, from N ranks to M;
`"finished_epoch"`, in a state saved after a loop ended, names that epoch. The passes and the
state are computed in `loader_passes.py`; the plan, the checks on load and an iterable dataset's
resumed epoch in `loader_resume.py`.
Copy with: common/loader_warning.py, common/loading/epoch_read_ahead.py,
  common/resume/batch_seeds.py, common/resume/dataset_state.py, common/resume/elastic_rest.py,
  common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/workers/start_watch.py.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

import recipes.common.resume.state_keys as keys
from recipes.common.loading.epoch_read_ahead import settle_reads_ahead
from recipes.common.resume.batch_seeds import SeededFetcher
from recipes.common.resume.dataset_state import (
    DatasetStateCarrier,
    RotatedIter,
    StateLoadingInit,
)
from recipes.common.resume.loader_contract import Prefetching, ReadAheadAware
from recipes.common.resume.loader_counting import Counting
from recipes.common.resume.loader_passes import Passes
from recipes.common.resume.loader_resume import (
    EpochStarts,
    check_loadable,
    loader_plan,
    resumed_iterable,
    resumes_iterable,
)
from recipes.common.resume.loader_state import find_generators
from recipes.common.resume.pass_sampler import PassSampler
from recipes.common.resume.state_keys import STATE_VERSION
from recipes.common.workers.start_watch import watched_iterator

__all__ = ["STATE_VERSION", "StatefulLoader"]


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
        ...             state = {"loader": loader.state_dict(), "model": model.state_dict()}
        ...             torch.save(state, "ckpt.pt")
        >>> loader.load_state_dict(torch.load("ckpt.pt")["loader"])  # in the new process
        >>> for batch in loader: ...                                 # batch 101 onwards
    """

    def __init__(self, dataset, **kwargs: Any):
        if kwargs.get("in_order") is False and kwargs.get("num_workers", 0) > 0:
            raise ValueError(
                "in_order=False hands batches over in the order workers finish them, and a loader "
                "state counts the batches the loop received, not which ones: a resume would lose "
                "some and repeat others. Keep in_order=True (the default); a slow sample holds up "
                "only its own batch's place, which prefetch_factor covers."
            )
        if (
            kwargs.get("shuffle")
            and not isinstance(dataset, IterableDataset)
            and kwargs.get("sampler") is None
            and kwargs.get("batch_sampler") is None
        ):
            kwargs["shuffle"] = False
            kwargs["sampler"] = RandomSampler(
                dataset, generator=_order_generator(kwargs.get("generator"))
            )
        super().__init__(dataset, **kwargs)
        self._unshare_base_seed()
        self._passes = Passes(self)
        # the seed of every batch's own random draws (`batch_seeds.py`): from `generator=` when
        # given, else from torch's generator (so that `torch.manual_seed` reproduces runs)
        self._passes.seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
        )
        if self._passes.self_resuming and self.num_workers:
            # each batch brings its worker's dataset state back
            self.collate_fn = DatasetStateCarrier(self.collate_fn)
        if self.num_workers:
            # a sampler's own count now runs ahead of the loop: let it say so
            for holder in (self.batch_sampler, self.sampler):
                if isinstance(holder, ReadAheadAware):
                    holder.note_read_ahead(self.num_workers * (self.prefetch_factor or 2))

    def _unshare_base_seed(self) -> None:
        """DataLoader draws its workers' base seed from `generator=` (once per iterator: once
        per loader with persistent workers); a sampler drawing its order from the same generator
        would get an order that depends on the workers. The base seed gets its own, seeded from it.
        """
        shared = self.generator is not None and any(
            g is self.generator
            for g in find_generators(
                {"sampler": self.sampler, "batch_sampler": self.batch_sampler}
            ).values()
        )
        if shared:
            self.generator = _order_generator(self.generator)

    def _get_iterator(self):
        if self.num_workers > 0:
            # workers start: no thread of this process inside a read ahead at the fork
            settle_reads_ahead()
        rotate = getattr(self, "_rotate_next", 0)
        self._rotate_next = 0
        if rotate and self.num_workers > 0:  # a resumed epoch of a dataset with its own state
            return RotatedIter(self, rotate)
        # See NOTE [start watch]: a worker stuck in its fork is replaced.
        return watched_iterator(self, super()._get_iterator)

    # The one hook into DataLoader's internals (see the module doc). The wrapper holds the
    # pass tracker, never the loader (see `Passes`).
    @property
    def _index_sampler(self):
        return PassSampler(super()._index_sampler, self._passes)

    def __iter__(self):
        return Counting(
            self._passes, *self._begin_pass(), restart=weakref.WeakMethod(self._begin_pass)
        )

    def _begin_pass(self):
        """(the pass begun, DataLoader's iterator over it): the loaded state's, else a fresh
        epoch."""
        current = self._passes.start(self.num_workers)
        iterable = isinstance(self.dataset, IterableDataset)
        if iterable:
            # nothing to draw: the order is the dataset's (epoch, rank, worker)
            current.drawn = True
        if iterable and resumes_iterable(current):
            starts = EpochStarts(plain=self._plain_epoch, loading_states=self._loading_states)
            inner = resumed_iterable(self, current, starts)
        else:
            if current.resumed is None and isinstance(self.dataset, Prefetching):
                # before the workers fork
                self.dataset.start_downloads(num_workers=max(1, self.num_workers))
            inner = super().__iter__()
            if hasattr(inner, "_dataset_fetcher") and not iterable:
                # no workers: batches made here, seeded
                inner._dataset_fetcher = SeededFetcher(inner._dataset_fetcher)
        _track(inner)
        return current, inner

    def _plain_epoch(self):
        """DataLoader's own iterator over one epoch (`EpochStarts.plain`)."""
        return DataLoader.__iter__(self)

    def _loading_states(self, states: dict, first_worker: int):
        """Fresh workers, each loading its dataset copy's state from `states` first, the
        round-robin begun at `first_worker` (`EpochStarts.loading_states`). Persistent workers
        started here stay for the next epochs, as the saving run's did."""
        if self._iterator is not None:
            # persistent workers hold copies that went on: fresh ones load the states
            self._iterator._shutdown_workers()
            self._iterator = None
        user_init = self.worker_init_fn
        self.worker_init_fn = StateLoadingInit(user_init, states)
        self._rotate_next = first_worker
        try:
            inner = self._get_iterator()
        finally:
            self.worker_init_fn = user_init
        if self.persistent_workers:
            # the resumed copies go on into the next epochs, as the saving run's did
            self._iterator = inner
        return inner

    def close(self) -> None:
        """Shuts its persistent workers down now; otherwise they end when the loader is garbage
        collected, which may be long after the last epoch (a validation loader in a notebook,
        a test suite). Idempotent; the next `iter` starts new workers. Also `with loader:`. An
        epoch's iterator in use then raises `LoaderClosedError`; the state stays where it was."""
        current = self._passes.current
        if current is not None and not current.done:
            current.closed = True
        iterator = self._iterator
        self._iterator = None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def skipped_batches(self) -> int:
        """Batches at the start of the current pass that a resume skipped (0 before a pass)."""
        return getattr(self._passes.current, "skip", 0)

    def __enter__(self) -> StatefulLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is, as plain JSON: the epoch, the batches of it the loop received, the
        random state its order was drawn from, and the settings that shape it (see the module
        doc and `loader_contract.py` for what a state saved at each point resumes)."""
        state = self._passes.state()
        state[keys.PLAN] = loader_plan(self)
        state[keys.BATCH_SEED] = self._passes.seed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at the first batch not received when `state` was saved (on the next `iter`).

        An epoch-seeded sampler (or dataset) is set to the saved epoch now; calling its
        `set_epoch` with another epoch before iterating starts that epoch afresh instead.

        Raises:
            ValueError: not a loader state of this version, or one saved under other settings.
        """
        check_loadable(state, self)
        self._passes.load(state)
        if state.get(keys.BATCH_SEED) is not None:
            self._passes.seed = int(state[keys.BATCH_SEED])


def _order_generator(seeded_from: torch.Generator | None) -> torch.Generator:
    """The order's own generator: seeded from the user's `generator`, else from torch's RNG."""
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=seeded_from).item())
    return torch.Generator().manual_seed(seed)


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
