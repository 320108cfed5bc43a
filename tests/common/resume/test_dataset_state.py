"""A dataset's own state (`common/resume/dataset_state.py`, issue #28 review): a Hugging Face
`IterableDataset` resumed on persistent workers gets its next epoch whole after `set_epoch`;
a second epoch at the same epoch number is named; `RobustLoader` restarts a dataset that resumes
itself with the workers its epoch began with."""

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import IterableDataset, get_worker_info

from recipes.common import LoaderWarning, RobustLoader, StatefulLoader

datasets = pytest.importorskip("datasets")


def _hf():
    return datasets.Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=4)


def _resume(**kwargs):
    first = StatefulLoader(_hf(), batch_size=4, **kwargs)
    iterator = iter(first)
    head = [int(x) for _ in range(5) for x in next(iterator)["x"]]
    state = json.loads(json.dumps(first.state_dict()))
    second = StatefulLoader(_hf(), batch_size=4, **kwargs)
    second.load_state_dict(state)
    return head, second


def test_persistent_workers_resume_the_epoch_then_go_on_with_set_epoch():
    """The resumed epoch's workers stay for the next epochs, as the saving run's did (an epoch
    counter kept in their copies goes on: torchdata's TestMultiEpochState). Hugging Face applies
    a loaded state again while the epoch number is unchanged, so the next epoch is whole after
    `set_epoch`, as its docs ask; without it, the loader names the problem."""
    head, second = _resume(num_workers=2, persistent_workers=True)
    rest = [int(x) for b in second for x in b["x"]]
    assert Counter(head + rest) == Counter(range(64))
    with pytest.warns(LoaderWarning, match="iterated again at epoch 0.*call its set_epoch"):
        iter(second)
    second.dataset.set_epoch(1)
    assert Counter(int(x) for b in second for x in b["x"]) == Counter(range(64))
    second.close()


def test_an_epoch_at_the_same_epoch_number_is_named_without_workers():
    head, second = _resume(num_workers=0)
    assert Counter(head + [int(x) for b in second for x in b["x"]]) == Counter(range(64))
    with pytest.warns(LoaderWarning, match="iterated again at epoch 0.*call its set_epoch"):
        list(second)
    second.dataset.set_epoch(1)  # as Hugging Face asks: the next epoch whole
    assert Counter(int(x) for b in second for x in b["x"]) == Counter(range(64))


class KeepsPosition(IterableDataset):
    """range(n) split over workers; its position is its state; a worker dies once at `die_at`."""

    def __init__(self, n, marker, die_at):
        self.n, self.next, self.marker, self.die_at = n, 0, Path(marker), die_at

    def __iter__(self):
        info = get_worker_info()
        mine = range(info.id, self.n, info.num_workers) if info else range(self.n)
        while self.next < len(mine):
            item = mine[self.next]
            self.next += 1
            if item == self.die_at and info is not None and not self.marker.exists():
                self.marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            yield item
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = int(state["next"])


def test_robust_loader_restarts_a_dataset_that_resumes_itself_on_its_worker_count(tmp_path):
    """Halving the workers mid-epoch was refused (its states, like a replay, belong to the
    worker count the epoch began with): the restart keeps it."""
    loader = RobustLoader(
        KeepsPosition(64, tmp_path / "died", die_at=30), batch_size=4, num_workers=2, timeout=30
    )
    with pytest.warns(LoaderWarning, match="worker died"):
        got = [int(x) for b in loader for x in b]
    assert (tmp_path / "died").exists() and Counter(got) == Counter(range(64))
    assert loader.loader.num_workers == 2


class Uneven(IterableDataset):
    """Worker w yields its own range of `sizes[w]` items (worker 0 none); its position is its
    state."""

    def __init__(self, sizes):
        self.sizes, self.resume, self.i = sizes, None, 0

    def __iter__(self):
        worker = get_worker_info().id
        self.i, self.resume = self.resume or 0, None
        start = sum(self.sizes[:worker])
        for value in range(start + self.i, start + self.sizes[worker]):
            self.i += 1
            yield value
        self.i = 0

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.resume = int(state["i"])


@pytest.mark.parametrize("cut", [1, 2, 7])
def test_the_round_robin_resumes_after_the_worker_that_made_the_last_batch(cut):
    """A worker with no data ends at once: the next turn is not `batches % workers` but the
    worker after the one that made the last batch received (as in the uninterrupted run)."""

    def build():
        return StatefulLoader(Uneven([0, 20, 9]), batch_size=2, num_workers=3)

    whole = [b.tolist() for b in build()]
    first, head = build(), []
    for batch in first:
        head.append(batch.tolist())
        if len(head) == cut:
            break
    state = json.loads(json.dumps(first.state_dict()))
    second = build()
    second.load_state_dict(state)
    assert head + [b.tolist() for b in second] == whole


class OwnIterator(IterableDataset):
    """Its own iterator over range(n); its position is its state."""

    def __init__(self, n):
        self.n, self.i = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = int(state["i"])


def test_a_state_saved_before_the_first_batch_is_loaded_too():
    """A state saved at zero (right after `iter`) holds the dataset's position: a loader given
    it, over the same dataset object already used up, starts from there (no batch skipped, so
    the path that loads states was not taken)."""
    data = OwnIterator(20)
    first = StatefulLoader(data, batch_size=4)
    iter(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert len(list(first)) == 5  # the object is used up now
    second = StatefulLoader(data, batch_size=4)
    second.load_state_dict(state)
    assert [int(x) for b in second for x in b] == list(range(20))
