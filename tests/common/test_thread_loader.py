"""ThreadLoader and make_loader's path choice (issue 21): batches read by threads of this process,
yielded in order, with StatefulLoader's exact resume in any epoch and at the boundaries; the
exactly-once state machine (test_exactly_once.py) also draws the thread path."""

import json
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from recipes.common import LoaderMonitor, StatefulLoader, ThreadLoader, make_loader


class Slow(Dataset):
    """Batches of indices, read in threads at random speeds (so they finish out of order); the
    reads count which threads ran them and how many ran at once."""

    def __init__(self, n=50):
        self.n, self.lock, self.threads, self.running, self.most = n, threading.Lock(), set(), 0, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)

    def thread_batches(self):
        return True

    def read_batch(self, indices, rng):
        with self.lock:
            self.threads.add(threading.get_ident())
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(float(rng.uniform(0, 0.004)))  # the GIL released, as a preadv or a resize
        with self.lock:
            self.running -= 1
        return torch.tensor(indices), torch.from_numpy(rng.integers(0, 1000, len(indices)))


def _as_batch(items):
    return (torch.tensor(items),)


def _ids(loader):
    return [b[0].tolist() for b in loader]


def test_make_loader_takes_threads_for_a_memory_speed_dataset_and_says_why():
    loader = make_loader(Slow(), batch_size=4)
    assert isinstance(loader, ThreadLoader) and loader.recipe.reasons["path"].startswith("threads:")
    assert loader.recipe.settings["path"] == "threads" and loader.recipe.settings["threads"] >= 1
    workers = make_loader(Slow(), batch_size=4, path="workers")
    assert type(workers) is StatefulLoader and workers.recipe.reasons["path"] == "given"
    asked = make_loader(Slow(), batch_size=4, num_workers=1)
    assert type(asked) is StatefulLoader and "num_workers given" in asked.recipe.reasons["path"]

    class NotReady(Slow):
        def thread_batches(self):
            return False

    assert type(make_loader(NotReady(), batch_size=4)) is StatefulLoader
    with pytest.raises(ValueError, match=r"path='threads' needs .* NotReady cannot now"):
        make_loader(NotReady(), batch_size=4, path="threads")
    with pytest.raises(ValueError, match=r"\['num_workers'\] configure worker processes"):
        make_loader(Slow(), batch_size=4, path="threads", num_workers=2)
    with pytest.raises(ValueError, match="`path` must be one of"):
        make_loader(Slow(), batch_size=4, path="processes")
    with pytest.raises(TypeError, match="Plain has none"):  # no thread_batches()
        ThreadLoader(type("Plain", (Dataset,), {"__len__": lambda s: 3, "__getitem__": lambda s, i: i})(),
                     batch_size=2)


def test_batches_come_in_order_from_several_threads_with_the_epochs_order():
    ds = Slow(97)
    torch.manual_seed(0)
    threaded = make_loader(ds, batch_size=4, shuffle=True, path="threads")
    torch.manual_seed(0)
    plain = make_loader(Slow(97), batch_size=4, shuffle=True, num_workers=0, collate_fn=_as_batch)
    for _ in range(3):  # the same order as the worker path's, epoch after epoch
        assert _ids(threaded) == _ids(plain)
    assert len(ds.threads) > 1 and ds.most > 1  # really in parallel
    assert len(threaded) == 25


def test_random_draws_follow_the_batch_not_the_thread():
    ds = Slow(40)
    a = make_loader(ds, batch_size=4, shuffle=True, path="threads", generator=torch.Generator().manual_seed(1))
    b = ThreadLoader(Slow(40), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1),
                     threads=1, seed=a.seed)
    assert [x[1].tolist() for x in a] == [x[1].tolist() for x in b]


@pytest.mark.parametrize("epoch", [0, 1, 2])
@pytest.mark.parametrize("cut", [0, 1, 5, 12, 13])  # 13 batches: 0, inside, the last, after the last
def test_a_resume_in_any_epoch_is_the_uninterrupted_run(epoch, cut):
    def build(seed):
        torch.manual_seed(seed)  # the resumed process need not seed alike
        return make_loader(Slow(50), batch_size=4, shuffle=True, path="threads")

    whole = build(0)
    expected = [_ids(whole) for _ in range(epoch + 2)]
    first = build(0)
    for _ in range(epoch):
        list(first)
    iterator = iter(first)
    prefix = [next(iterator)[0].tolist() for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    second = build(123)
    second.load_state_dict(state)
    rest = _ids(second)
    assert Counter(map(tuple, prefix + rest)) == Counter(map(tuple, expected[epoch]))  # counted: none lost or repeated
    assert prefix + rest == expected[epoch]
    assert _ids(second) == expected[epoch + 1]  # and the epoch after is whole


def test_a_distributed_sampler_resumed_at_the_epoch_boundary_runs_the_next_epoch():
    def build():
        ds = Slow(30)
        sampler = DistributedSampler(ds, num_replicas=2, rank=1, seed=4)
        return make_loader(ds, batch_size=4, sampler=sampler, path="threads"), sampler

    loader, sampler = build()
    sampler.set_epoch(0)
    list(loader)
    state = loader.state_dict()  # saved after the epoch's end, before set_epoch(1)
    reference, ref_sampler = build()
    ref_sampler.set_epoch(1)
    expected = _ids(reference)
    resumed, resumed_sampler = build()
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(1)
    assert _ids(resumed) == expected and len(expected) == 4


def test_a_state_moves_between_the_thread_and_the_worker_paths():
    torch.manual_seed(3)
    threaded = make_loader(Slow(50), batch_size=5, shuffle=True, path="threads")
    list(threaded)
    iterator = iter(threaded)
    prefix = [next(iterator)[0].tolist() for _ in range(4)]
    torch.manual_seed(3)
    reference = make_loader(Slow(50), batch_size=5, shuffle=True, num_workers=0, collate_fn=_as_batch)
    list(reference)
    expected = _ids(reference)
    workers = make_loader(Slow(50), batch_size=5, shuffle=True, num_workers=2, collate_fn=_as_batch)
    workers.load_state_dict(threaded.state_dict())
    assert prefix + [b[0].tolist() for b in workers] == expected


def test_an_error_in_a_read_reaches_the_loop_with_its_type():
    class Bad(Slow):
        def read_batch(self, indices, rng):
            if 7 in indices:
                raise KeyError("index 7 is damaged")
            return super().read_batch(indices, rng)

    loader = make_loader(Bad(20), batch_size=4, path="threads")
    got = []
    with pytest.raises(KeyError, match="index 7 is damaged"):
        for batch in loader:
            got.append(batch[0].tolist())
    assert got == [[0, 1, 2, 3]]
    loader.close()


def test_the_monitor_reports_a_thread_loader():
    monitor = LoaderMonitor(make_loader(Slow(20), batch_size=4, path="threads"), warn_wait_fraction=1.0)
    for _ in monitor:
        pass
    assert monitor.summary()["samples"] == 20


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"\['num_workers', 'timeout'\]"):
        ThreadLoader(Slow(), batch_size=2, num_workers=2, timeout=5)
    with pytest.raises(ValueError, match="must be positive"):
        ThreadLoader(Slow(), batch_size=2, threads=0)
    assert np.all(np.diff([b[0][0].item() for b in ThreadLoader(Slow(8), batch_size=2, threads=3)]) == 2)


def test_a_collate_function_gets_the_items_in_a_thread():
    collated = []

    def collate(items):
        collated.append(threading.current_thread().name)
        return sorted(items)

    loader = make_loader(Slow(10), batch_size=4, collate_fn=collate)
    assert isinstance(loader, ThreadLoader) and [b for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(name.startswith("ThreadLoader") for name in collated)


def test_pinned_batches_are_filled_in_place_when_read_batch_can(monkeypatch):
    """With CUDA and pin_memory, a read_batch that takes `pin_memory=` gets it (and fills its
    batch in pinned memory itself); other batches are copied into pinned memory afterwards."""
    import recipes.common.thread_loader as module

    copied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module, "_pinned", lambda batch: copied.append(batch) or batch)

    class PinsItself(Slow):
        def read_batch(self, indices, rng, *, pin_memory=False):
            asked.append(pin_memory)
            return torch.tensor(indices), torch.zeros(len(indices))

    asked = []
    assert sum(len(b[0]) for b in ThreadLoader(PinsItself(10), batch_size=4, pin_memory=True)) == 10
    assert asked == [True] * 3 and copied == []
    assert sum(len(b[0]) for b in ThreadLoader(Slow(10), batch_size=4, pin_memory=True)) == 10
    assert len(copied) == 3
    asked.clear()
    list(ThreadLoader(PinsItself(10), batch_size=4))  # no pin_memory: not asked to pin
    assert asked == [False] * 3
