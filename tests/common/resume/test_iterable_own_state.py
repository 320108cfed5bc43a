"""Iterable datasets that resume themselves, the rest of torchdata's protocol (issue #28): the
iterator's own state (loaded after `iter(dataset)`), a dataset that is its own iterator and
resets in `__iter__`, random draws inside the iterator, a worker whose stream ended before the
save, a dataset's state at an epoch's end (an epoch counter kept in persistent workers' copies),
and a `state_dict()` that returns the dataset's live dict.

Each resumed run is compared with the uninterrupted run of the same settings; states go through
JSON, as a checkpoint would hold them.
"""

from __future__ import annotations

import json
import random
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from recipes.common import StatefulLoader, make_loader

WORKERS = [(0, False), (2, False), (2, True)]
WORKER_IDS = ["w0", "w2", "w2-persistent"]


def _worker():
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class DrawingIterator:
    """Items of a shard picked at random (with replacement) from torch's global generator; its
    state is its position and that generator's state (as torchdata's suite's iterator)."""

    def __init__(self, shard: list[int]):
        self.shard, self.i = shard, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.shard):
            raise StopIteration
        self.i += 1
        return self.shard[int(torch.randint(len(self.shard), ()))]

    def state_dict(self):
        return {"i": self.i, "rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


class UnevenShards(IterableDataset):
    """Worker w of W reads shard w of `sizes` (worker 0's shard is short: it ends early); no
    state of its own: its iterator keeps it."""

    def __init__(self, sizes=(6, 30)):
        self.sizes = list(sizes)

    def __iter__(self):
        wid, workers = _worker()
        sizes = self.sizes if workers > 1 else [sum(self.sizes)]
        start = sum(sizes[:wid])
        return DrawingIterator(list(range(start, start + sizes[wid])))


class GlobalDraws(IterableDataset):
    """range(n) split over workers, each item with draws from torch's, NumPy's and Python's
    global generators; no state at all (a resume reads the epoch's first batches again)."""

    def __init__(self, n=32):
        self.n = n

    def __iter__(self):
        wid, workers = _worker()
        for i in range(wid, self.n, workers):
            yield [
                i,
                round(torch.rand(()).item(), 6),
                round(float(np.random.rand()), 6),
                round(random.random(), 6),
            ]


class CountsEpochs(IterableDataset):
    """torchdata's GeneratorIterable: its position and an epoch counter it moves on itself when
    its stream ends; items are (i, epoch)."""

    def __init__(self, sizes=(10, 14)):
        self.sizes, self.resume, self.epoch, self.i = list(sizes), None, 0, 0

    def __iter__(self):
        wid, workers = _worker()
        sizes = self.sizes if workers > 1 else [sum(self.sizes)]
        self.i, self.resume = (self.resume or 0), None
        start = sum(sizes[:wid])
        for item in range(start + self.i, start + sizes[wid]):
            self.i += 1
            yield [item, self.epoch]
        self.i = 0
        self.epoch += 1

    def state_dict(self):
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.resume, self.epoch = state["i"], state["epoch"]


class ResetsInIter(IterableDataset):
    """Its own iterator, which `__iter__` resets to the start of the worker's share (torchdata's
    CountIterCallsIter): its state must be loaded after `iter()`, or the reset undoes it."""

    def __init__(self, n=40):
        self.n, self.iter_calls = n, 0

    def __iter__(self):
        self.iter_calls += 1
        wid, workers = _worker()
        share = self.n // workers
        self.curr, self.end = share * wid, share * (wid + 1)
        return self

    def __next__(self):
        if self.curr >= self.end:
            raise StopIteration
        self.curr += 1
        return self.curr - 1

    def state_dict(self):
        return {"curr": self.curr, "end": self.end, "iter_calls": self.iter_calls}

    def load_state_dict(self, state):
        self.curr, self.end = state["curr"], state["end"]


class LiveDict(IterableDataset):
    """Its `state_dict()` returns its own dict, which it goes on changing (torchdata's
    PeriodicStateIterableDataset): a state must be a copy taken with the batch."""

    def __init__(self, limit=40):
        self.state, self.step, self.limit = {"0": 0, "1": 0, "2": 0}, 0, limit

    def __iter__(self):
        while self.step < self.limit:
            self.step += 1
            slot = str(self.step % 3)
            self.state[slot] = 1 - self.state[slot]
            yield [self.step, self.state[slot]]

    def state_dict(self):
        return {"state": self.state, "step": self.step}

    def load_state_dict(self, state):
        self.state, self.step = dict(state["state"]), state["step"]


# ---- helpers --------------------------------------------------------------------------------
def kwargs(workers, persistent):
    return {"num_workers": workers, **({"persistent_workers": persistent} if workers else {})}


def as_list(items):
    """The collate: a batch is the list of its items."""
    return items


def rows(batch):
    """A batch (a list of items, or one item without batching) as plain values."""
    if isinstance(batch, list) and batch and isinstance(batch[0], list):
        return [[float(x) for x in row] for row in batch]
    return batch


def epoch(loader):
    return [rows(b) for b in loader]


def resumed_epoch(build, k):
    """The first `k` batches of a loader's epoch (left by `break`), then the rest from a fresh
    loader given its state through JSON; k=0: the state right after `iter()`."""
    first = build()
    head = []
    iterator = iter(first)
    for _ in range(k):
        head.append(rows(next(iterator)))
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    second = build()
    second.load_state_dict(state)
    return head, second


def items(batches):
    """The sample ids of batches: an item, or a row's first value."""
    return [
        int(row[0]) if isinstance(row, list) else int(row) for batch in batches for row in batch
    ]


# ---- the iterator's own state, random draws inside it ----------------------------------------
@pytest.mark.parametrize("k", [0, 1, 5, 12])  # 12: after worker 0's short shard ended
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_an_iterators_own_state_and_draws_resume_exactly(workers, persistent, k):
    def build():
        return StatefulLoader(
            UnevenShards(), batch_size=2, collate_fn=as_list, **kwargs(workers, persistent)
        )

    torch.manual_seed(11)
    full = epoch(build())
    torch.manual_seed(11)  # the same loader seed; the resumed loader's comes from the state
    head, second = resumed_epoch(build, k)
    torch.manual_seed(999)  # another process: its own generators
    assert head + epoch(second) == full
    assert len(items(full)) == 36


@pytest.mark.parametrize("workers", [0, 2])
def test_make_loader_resumes_an_iterators_own_state(workers):
    def build():
        return make_loader(UnevenShards(), batch_size=2, collate_fn=as_list, num_workers=workers)

    torch.manual_seed(5)
    full = epoch(build())
    torch.manual_seed(5)
    head, second = resumed_epoch(build, 7)
    assert head + epoch(second) == full


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("workers, persistent", WORKERS[1:], ids=WORKER_IDS[1:])
def test_global_draws_in_workers_replay_with_the_epoch(workers, persistent, k):
    """Each worker's generators are seeded per pass from (the loader's seed, epoch, worker), so a
    dataset with no state of its own, read again to resume, draws what it drew; every epoch
    draws anew."""

    def build():
        return StatefulLoader(
            GlobalDraws(), batch_size=4, collate_fn=as_list, **kwargs(workers, persistent)
        )

    torch.manual_seed(3)
    reference = build()
    epochs = [epoch(reference) for _ in range(2)]
    assert [r[1:] for b in epochs[0] for r in b] != [r[1:] for b in epochs[1] for r in b]
    torch.manual_seed(3)
    first = build()
    epoch(first)
    iterator = iter(first)
    head = [rows(next(iterator)) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    second = build()
    second.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no resume_after(); reading and discarding ..."
        assert head + epoch(second) == epochs[1]


# ---- a dataset that is its own iterator and resets in __iter__ -------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_resets_in_iter_resumes_from_its_state(workers):
    def build():
        return StatefulLoader(ResetsInIter(40), batch_size=None, num_workers=workers)

    full = [int(x) for x in build()]
    head, second = resumed_epoch(build, 10)
    got = head + [int(x) for x in second]
    assert got == full
    assert Counter(got) == Counter(range(40))


# ---- a worker whose stream ended stays ended -------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_whose_stream_ended_before_the_save_stays_ended(persistent):
    def build():
        return StatefulLoader(
            CountsEpochs((2, 20)),
            batch_size=2,
            collate_fn=as_list,
            num_workers=2,
            persistent_workers=persistent,
        )

    full = epoch(build())
    head, second = resumed_epoch(build, 6)  # worker 0 ended after its one batch
    got = head + epoch(second)
    assert got == full
    assert Counter(items(got)) == Counter(range(22))


# ---- a dataset's state at an epoch's end ----------------------------------------------------
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_a_state_saved_at_an_epochs_end_carries_the_copies_epoch_counter(workers, persistent):
    """torchdata's TestMultiEpochState: the copies that outlive an epoch (persistent workers',
    this process's) count epochs themselves; a state saved at the end resumes the next epochs as
    the uninterrupted run has them (fresh workers' copies restart their count in both runs)."""

    def build():
        return StatefulLoader(
            CountsEpochs(), batch_size=None, collate_fn=None, **kwargs(workers, persistent)
        )

    reference = build()
    full = [epoch(reference) for _ in range(3)]
    counters = {int(item[1]) for one in full for item in one}
    assert (len(counters) > 1) == (
        persistent or not workers
    )  # the copies count epochs where they outlive them
    first = build()
    epoch(first)
    state = json.loads(json.dumps(first.state_dict()))
    del first
    second = build()
    list(
        zip(range(2), second, strict=False)
    )  # the new loader's copies move on first: the state decides
    second.load_state_dict(state)
    assert [epoch(second) for _ in range(2)] == full[1:]


# ---- a state_dict() that returns a live dict -------------------------------------------------
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_a_state_is_a_copy_of_a_live_dict(workers, persistent):
    def build():
        return StatefulLoader(
            LiveDict(), batch_size=1, collate_fn=as_list, **kwargs(workers, persistent)
        )

    full = epoch(build())
    first = build()
    iterator = iter(first)
    head = [rows(next(iterator)) for _ in range(9)]
    state = first.state_dict()  # kept in memory while the loop goes on, as a step-limited loop may
    [next(iterator) for _ in range(4)]
    state = json.loads(json.dumps(state))
    del iterator, first
    second = build()
    second.load_state_dict(state)
    assert head + epoch(second) == full


class CountsPasses(IterableDataset):
    """Its own iterator, which counts its passes in its state (the review's repro): items are
    (sample, pass number of this copy)."""

    def __init__(self, n=8):
        self.n, self.passes, self.curr, self.end = n, 0, 0, 0

    def __iter__(self):
        wid, workers = _worker()
        self.passes += 1
        share = self.n // workers
        self.curr, self.end = wid * share, (wid + 1) * share
        return self

    def __next__(self):
        if self.curr >= self.end:
            raise StopIteration
        self.curr += 1
        return [self.curr - 1, self.passes]

    def state_dict(self):
        return {"curr": self.curr, "end": self.end, "passes": self.passes}

    def load_state_dict(self, state):
        self.curr, self.end, self.passes = state["curr"], state["end"], state["passes"]


@pytest.mark.parametrize(
    "workers, persistent", [(0, False), (2, True)], ids=["w0", "w2-persistent"]
)
def test_a_dataset_that_is_its_own_iterator_carries_its_count_past_an_epochs_end(
    workers, persistent
):
    def build():
        return StatefulLoader(
            CountsPasses(),
            batch_size=None,
            collate_fn=None,
            **kwargs(workers, persistent),
        )

    reference = build()
    full = [epoch(reference) for _ in range(3)]
    first = build()
    epoch(first)
    state = json.loads(json.dumps(first.state_dict()))
    del first
    second = build()
    second.load_state_dict(state)
    assert [epoch(second) for _ in range(2)] == full[1:]


class UnevenPasses(CountsPasses):
    """`CountsPasses` whose worker 0 has one item and worker 1 five."""

    def __iter__(self):
        wid, workers = _worker()
        self.passes += 1
        self.curr, self.end = ((0, 1), (1, 6))[wid] if workers > 1 else (0, 6)
        return self


def test_a_persistent_worker_whose_own_iterator_had_ended_keeps_its_count():
    """Worker 0's share ends first; a state saved then, resumed on persistent workers: that
    copy's later epochs count on from its saved count (it is loaded though it makes no batch)."""

    def build():
        return StatefulLoader(
            UnevenPasses(),
            batch_size=None,
            collate_fn=None,
            num_workers=2,
            persistent_workers=True,
        )

    reference = build()
    full = [epoch(reference) for _ in range(3)]
    first = build()
    epoch(first)
    iterator = iter(first)
    head = [rows(next(iterator)) for _ in range(3)]  # 0, 1, then worker 0's end, then 2
    state = json.loads(json.dumps(first.state_dict()))
    assert state["dataset_states"]["0"]["ended"] and not state["dataset_states"]["1"]["ended"]
    del iterator, first
    second = build()
    second.load_state_dict(state)
    assert [head + epoch(second), epoch(second)] == full[1:]


def test_after_a_break_persistent_copies_start_the_next_epoch_fresh():
    """Epoch 0 left by `break` on persistent workers, epoch 1 iterated on the same loader and
    saved after its first batch: the workers that had not yet given a batch in epoch 1 resume
    from its start, not from where epoch 0 was left (the review's repro lost two samples)."""

    def build():
        return StatefulLoader(
            CountsEpochs((12, 12)),
            batch_size=2,
            collate_fn=as_list,
            num_workers=2,
            persistent_workers=True,
        )

    reference = build()
    iterator = iter(reference)
    next(iterator), next(iterator)
    del iterator
    full = epoch(reference)
    first = build()
    iterator = iter(first)
    next(iterator), next(iterator)
    del iterator
    iterator = iter(first)
    head = [rows(next(iterator))]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    second = build()
    second.load_state_dict(state)
    got = head + epoch(second)
    assert Counter(items(got)) == Counter(items(full))
    assert got == full


def test_another_worker_count_is_refused_naming_the_one_to_use():
    first = StatefulLoader(UnevenShards(), batch_size=2, collate_fn=as_list, num_workers=2)
    iterator = iter(first)
    next(iterator)
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    second = StatefulLoader(UnevenShards(), batch_size=2, collate_fn=as_list, num_workers=1)
    second.load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers=2"):
        iter(second)


@pytest.fixture(autouse=True)
def _quiet_worker_count_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        yield
