"""A dataset's own state: iterable datasets that resume themselves (`state_dict()` /
`load_state_dict()`).

Use when: an iterable dataset, or the iterator its `__iter__` returns, keeps its position (and
perhaps its epoch or random state) and says so with `state_dict()` / `load_state_dict()`:
torchdata's protocol, which Hugging Face `datasets.IterableDataset` implements. `StatefulLoader`
saves, per dataset copy (each worker's, or this process's), the state it had after its last
batch the loop received, and a resumed loader loads it there, in torchdata's order: the
dataset's state, then `iter(dataset)`, then the iterator's state. Nothing is read twice
(without the protocol, an iterable dataset with no `resume_after` is replayed and its first
batches dropped).
Cost: with workers, one `state_dict()` and a deep copy of it per batch in the worker that made
it (carried back with the batch; about 10 us for a small dict), and one more where a worker's
stream ends; without workers, one per `loader.state_dict()`.
Adapt here: `fetch_with_state` (what a worker's fetch sends back), `copy_state` (what a state
holds). Trade-off: each worker's state belongs to its share of the data, so a resume needs the same
number of workers (another number is refused, naming the one to use; `RobustLoader` keeps it when it
restarts mid-epoch); the round-robin over the workers resumes after the worker that made the last
batch received, as the uninterrupted run's does, and a worker whose stream had ended stays ended. A
worker's stream end is a message of its own (its dataset's state after the
end: an epoch counter kept in the dataset moves on there); the loop never sees it. A state
saved after an epoch ended carries the copies' dataset states when they outlive the epoch
(persistent workers; without workers, this process's copy; a dataset that is its own iterator
carries its iterator's state); after a `break` they are unknown (persistent workers read
ahead), so the next epoch's states begin from fresh. With persistent workers the resumed
epoch's workers stay for the next epochs, as the uninterrupted run's did. A dataset that
applies a loaded state at every `iter` of the same epoch number (Hugging Face's) needs
`set_epoch` each epoch; the loader warns when it is iterated again at the same epoch.
Copy with: common/resume/batch_seeds.py, common/resume/loader_contract.py,
  common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils import fetch as _fetch
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import recipes.common.resume.state_keys as keys
from recipes.common.resume.batch_seeds import batch_seed, seed_globals
from recipes.common.resume.loader_contract import ResumableIterable, StatefulDataset
from recipes.common.resume.state_records import WorkerResume


def keeps_own_state(dataset) -> bool:
    """An iterable dataset that resumes itself (the protocol), and has no `resume_after`."""
    return may_resume_itself(dataset) and isinstance(dataset, StatefulDataset)


def may_resume_itself(dataset) -> bool:
    """An iterable dataset with no `resume_after`: it, or the iterator its `__iter__` returns,
    may keep a state of its own (known only once iterated, in each worker)."""
    return isinstance(dataset, IterableDataset) and not isinstance(dataset, ResumableIterable)


def copy_state(dataset, iterator, ended: bool) -> dict[str, Any] | None:
    """A dataset copy's state as torchdata keeps it: the dataset's own (when it is not its own
    iterator), its iterator's, and whether its stream ended, copied; None when neither has a state.
    """
    own = None
    if iterator is not dataset and isinstance(dataset, StatefulDataset):
        own = dataset.state_dict()
    position = None
    if isinstance(iterator, StatefulDataset):
        position = iterator.state_dict()
    if own is None and position is None:
        return None
    # a copy: a state_dict() may return the dataset's own dict, which it changes as it goes on
    # (in a worker, while the queue's feeder thread pickles the batch)
    state = {keys.COPY_DATASET: own, keys.COPY_ITERATOR: position, keys.COPY_ENDED: bool(ended)}
    if iterator is dataset:  # its own iterator: after its epoch, its state is the dataset's too
        state[keys.COPY_OWN_ITERATOR] = True
    return copy.deepcopy(state)


class Carried:
    """A batch and the state of the worker's dataset copy right after making it; `ended`: no
    batch, the worker's stream ended (its state after the end)."""

    __slots__ = ("batch", "worker", "state", "ended")

    def __init__(self, batch, worker: int, state, ended: bool = False):
        self.batch = batch
        self.worker = worker
        self.state = state
        self.ended = ended

    def pin_memory(self, *args) -> Carried:  # DataLoader's pin-memory thread pins what it carries
        from torch.utils.data._utils.pin_memory import pin_memory

        return Carried(pin_memory(self.batch, *args), self.worker, self.state, self.ended)


class DatasetStateCarrier:
    """The loader's collate function; marks a loader whose workers' fetches send their dataset
    copy's state back with each batch (`fetch_with_state`)."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, items):
        return self.collate_fn(items)


# A resumed worker's iterator state, loaded into the first fetcher the worker makes (right
# after the worker init, which sets it), or None.
_PENDING: WorkerResume | None = None


class StateLoadingInit:
    """The worker init of a resumed epoch: the user's, then its dataset copy's saved state (the
    iterator's is loaded once `iter(dataset)` made it, `_init_with_state`)."""

    def __init__(self, user_init, states: dict[str, Any]):
        self.user_init = user_init
        self.states = states

    def __call__(self, worker_id: int) -> None:
        global _PENDING
        if self.user_init is not None:
            self.user_init(worker_id)
        state = self.states.get(str(worker_id))
        if state is None:
            return
        own = state.get(keys.COPY_DATASET)
        if own is None and state.get(keys.COPY_OWN_ITERATOR) and state.get(keys.COPY_ENDED):
            # an ended dataset that is its own iterator: no iter() will load it
            own = state.get(keys.COPY_ITERATOR)
        if own is not None:
            get_worker_info().dataset.load_state_dict(own)
        _PENDING = WorkerResume(state.get(keys.COPY_ITERATOR), bool(state.get(keys.COPY_ENDED)))


_plain_init = _fetch._IterableDatasetFetcher.__init__
_plain_fetch = _fetch._IterableDatasetFetcher.fetch


def _init_with_state(self, dataset, auto_collation, collate_fn, drop_last) -> None:
    """DataLoader's iterable fetcher. In a worker of a loader whose collate is a
    `DatasetStateCarrier`, `iter(dataset)` waits for the first fetch (`_begin`); the first
    fetcher a resumed worker makes takes its saved iterator state along."""
    global _PENDING
    pending = _PENDING
    _PENDING = None
    if get_worker_info() is None or not isinstance(collate_fn, DatasetStateCarrier):
        _plain_init(self, dataset, auto_collation, collate_fn, drop_last)
        return
    _fetch._BaseDatasetFetcher.__init__(self, dataset, auto_collation, collate_fn, drop_last)
    self.dataset_iter = None
    self.ended = False
    self._pending = pending


def _begin(self, index, worker: int) -> None:
    """A pass's first fetch in a worker: the generators seeded from the pass's seed (the index
    carries it, `batch_seeds.py`) and the worker, then `iter(dataset)`, then a resumed worker's
    iterator state (torchdata's order); a worker whose stream had ended stays ended."""
    pending = self._pending or WorkerResume(None, False)
    if pending.ended:  # its end was received before the state was saved: no batch, no second end
        self.ended = self._sent_end = True
        return
    seed = getattr(index, "seed", None)
    if seed is not None:
        seed_globals(batch_seed(seed, worker, 1))
    self.dataset_iter = iter(self.dataset)
    if pending.iterator is not None:
        self.dataset_iter.load_state_dict(pending.iterator)


def fetch_with_state(self, possibly_batched_index):
    """DataLoader's iterable fetch, in a worker of a loader whose collate is a
    `DatasetStateCarrier`: each batch comes back `Carried` with its copy's state, and the end
    of the stream as a `Carried` of its own before the StopIteration. Elsewhere, unchanged."""
    info = get_worker_info()
    if info is None or not isinstance(self.collate_fn, DatasetStateCarrier):
        return _plain_fetch(self, possibly_batched_index)
    if self.dataset_iter is None and not self.ended:
        _begin(self, possibly_batched_index, info.id)
    try:
        batch = _plain_fetch(self, possibly_batched_index)
    except StopIteration:
        self.ended = True  # (without batching, the fetch does not set it)
        if getattr(self, "_sent_end", False):
            raise
        self._sent_end = True
        return Carried(None, info.id, copy_state(self.dataset, self.dataset_iter, True), ended=True)
    return Carried(batch, info.id, copy_state(self.dataset, self.dataset_iter, self.ended))


# Installed on import: a spawned worker imports this module when it unpickles its collate.
_fetch._IterableDatasetFetcher.__init__ = _init_with_state
_fetch._IterableDatasetFetcher.fetch = fetch_with_state


def live_state(dataset, inner) -> dict[str, Any] | None:
    """Without workers: this process's copy's state, read from DataLoader's iterator `inner`."""
    fetcher = getattr(inner, "_dataset_fetcher", None)
    if fetcher is not None:
        return copy_state(dataset, fetcher.dataset_iter, fetcher.ended)
    # its iterator is gone: the dataset's own state, unless it is its own iterator
    if hasattr(dataset, "__next__"):
        return copy_state(dataset, dataset, False)
    return copy_state(dataset, None, False)


def _carried_part(state: dict[str, Any] | None):
    """What of a copy's state the next epoch's copy begins with: the dataset's own, else the
    iterator's of a dataset that is its own iterator; None when neither."""
    if state is None:
        return None
    if state.get(keys.COPY_DATASET) is not None:
        return state[keys.COPY_DATASET]
    if state.get(keys.COPY_OWN_ITERATOR):
        return state.get(keys.COPY_ITERATOR)
    return None


def carried_over(states: dict[str, Any]) -> dict[str, Any]:
    """What copies that outlive an epoch begin the next with: each one's dataset state (its
    iterator's is replaced by the next `iter(dataset)`; a dataset that is its own iterator
    carries that state, loaded before its next `iter`)."""
    out = {}
    for w, s in states.items():
        own = _carried_part(s)
        if own is not None:
            out[w] = {keys.COPY_DATASET: own, keys.COPY_ITERATOR: None, keys.COPY_ENDED: False}
    return out


class RotatedIter(_MultiProcessingDataLoaderIter):
    """DataLoader's worker iterator whose round-robin begins at worker `first` (a resumed epoch:
    the worker whose turn was next)."""

    def __init__(self, loader, first: int):
        self._rotate = first
        super().__init__(loader)

    def _try_put_index(self):
        if self._rotate:
            self._worker_queue_idx_cycle = itertools.islice(
                itertools.cycle(range(self._num_workers)), self._rotate, None
            )
            self._rotate = 0
        super()._try_put_index()
