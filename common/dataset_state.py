"""A dataset's own state: iterable datasets that resume themselves (`state_dict()` / `load_state_dict()`).

Use when: an iterable dataset keeps its position (and perhaps its epoch or random state) and
says so with `state_dict()` / `load_state_dict()`: torchdata's protocol, which Hugging Face
`datasets.IterableDataset` implements. `StatefulLoader` saves the state of the dataset copy
that made each batch the loop received, and a resumed loader loads it into that copy, which
goes on from there: nothing is read twice (without the protocol, an iterable dataset with no
`resume_after` is replayed and its first batches dropped).
Cost: with workers, one `state_dict()` per batch in the worker that made it (carried back with
the batch); without workers, one `state_dict()` per `loader.state_dict()`.
Adapt here: `DatasetStateCarrier` (how a worker's state travels with its batch).
Trade-off: each worker's state belongs to its share of the data, so a resume needs the same
number of workers (another number is refused, naming the one to use; `RobustLoader` keeps it
when it restarts mid-epoch); the round-robin over the workers resumes after the worker that made the last batch received,
as the uninterrupted run's does (a worker that ended on the way is passed over by both). The
resumed epoch runs on workers of its own (persistent ones would keep the loaded states). States
are saved only mid-epoch: a state saved after an epoch ended starts the next epoch with a
fresh `iter(dataset)`. A dataset that applies a loaded state at every `iter` of the same epoch
number (Hugging Face's) needs `set_epoch` each epoch; the loader warns when it is iterated
again at the same epoch.
Copy with: common/loader_contract.py.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from recipes.common.loader_contract import ResumableIterable, StatefulDataset


def keeps_own_state(dataset) -> bool:
    """An iterable dataset that resumes itself (the protocol), and has no `resume_after`."""
    return isinstance(dataset, IterableDataset) and isinstance(dataset, StatefulDataset) and \
        not isinstance(dataset, ResumableIterable)


class Carried:
    """A batch and the state of the worker's dataset copy right after making it."""

    __slots__ = ("batch", "worker", "state")

    def __init__(self, batch, worker: int, state):
        self.batch, self.worker, self.state = batch, worker, state

    def pin_memory(self, *args) -> Carried:  # DataLoader's pin-memory thread pins what it carries
        from torch.utils.data._utils.pin_memory import pin_memory

        return Carried(pin_memory(self.batch, *args), self.worker, self.state)


class DatasetStateCarrier:
    """The loader's collate function, which in a worker also returns its dataset copy's state."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, items):
        batch = self.collate_fn(items)
        info = get_worker_info()
        if info is None:
            return batch
        return Carried(batch, info.id, info.dataset.state_dict())


class StateLoadingInit:
    """The worker init of a resumed epoch: the user's, then its dataset copy's saved state."""

    def __init__(self, user_init, states: dict[str, Any]):
        self.user_init, self.states = user_init, states

    def __call__(self, worker_id: int) -> None:
        if self.user_init is not None:
            self.user_init(worker_id)
        state = self.states.get(str(worker_id))
        if state is not None:
            get_worker_info().dataset.load_state_dict(state)


class RotatedIter(_MultiProcessingDataLoaderIter):
    """DataLoader's worker iterator whose round-robin begins at worker `first` (a resumed epoch:
    the worker whose turn was next)."""

    def __init__(self, loader, first: int):
        self._rotate = first
        super().__init__(loader)

    def _try_put_index(self):
        if self._rotate:
            self._worker_queue_idx_cycle = itertools.islice(
                itertools.cycle(range(self._num_workers)), self._rotate, None)
            self._rotate = 0
        super()._try_put_index()
