"""RobustLoader: an epoch survives a killed worker, a hang and a full /dev/shm, yielding every
planned batch exactly once, in order (issue #10)."""

import os
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from recipes.common import (
    LengthBucketSampler,
    LoaderWarning,
    RobustLoader,
    ShardedIterableDataset,
    make_loader,
)
from recipes.testing import make_int_shards


class Faulty(Dataset):
    """Index i; in a worker, the first time `fault_at` is fetched: `kill` (SIGKILL), `hang`, or
    `raise`."""

    def __init__(self, n, marker, fault_at=None, fault="kill"):
        self.n, self.marker, self.fault_at, self.fault = n, Path(marker), fault_at, fault

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if (
            i == self.fault_at
            and (self.fault == "raise" or get_worker_info() is not None)
            and _first(self.marker)
        ):
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.fault == "hang":
                time.sleep(120)
            else:
                raise RuntimeError(f"record {i} is corrupt")  # the dataset's own error
        return i


def _first(marker):
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def read_ints(path, marker=None, kill_value=None):
    values = [int(x) for x in Path(path).read_text().split()]
    if kill_value in values and get_worker_info() is not None and _first(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    return values


class KillingReader:
    def __init__(self, marker, kill_value):
        self.marker, self.kill_value = marker, kill_value

    def __call__(self, path):
        return read_ints(path, self.marker, self.kill_value)


def _setup(kind, marker, tmp_path):
    """(dataset, loader kwargs) with a worker that dies the first time it meets its fault."""
    if kind == "sharded":
        paths = make_int_shards(tmp_path, [9, 14, 6, 11, 8, 12])
        ds = ShardedIterableDataset(
            paths,
            KillingReader(marker, 33),
            shard_lengths=[9, 14, 6, 11, 8, 12],
            seed=2,
            rank=0,
            world_size=1,
        )
        ds.set_epoch(1)
        return ds, {"batch_size": 4}
    ds = Faulty(80, marker, fault_at=37)
    if kind == "shuffle":
        return ds, {"batch_size": 4, "shuffle": True}
    if kind == "distributed":
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=1)
        sampler.set_epoch(3)
        ds.fault_at = list(sampler)[20]  # an index of this rank
        return ds, {"batch_size": 3, "sampler": sampler}
    lengths = np.random.default_rng(1).integers(4, 50, 80)
    sampler = LengthBucketSampler(lengths, max_tokens=160, seed=2)
    sampler.set_epoch(1)
    return ds, {"batch_sampler": sampler}


def _ids(batch):
    return batch.flatten().tolist()


@pytest.mark.parametrize("kind", ["shuffle", "distributed", "bucket", "sharded"])
def test_a_killed_worker_costs_a_restart_not_the_epoch(kind, tmp_path):
    marker = tmp_path / "fired"
    ds, kwargs = _setup(kind, marker, tmp_path)
    marker.touch()  # the reference epoch runs without the fault
    torch.manual_seed(0)
    expected = [_ids(b) for b in make_loader(ds, num_workers=2, **kwargs)]
    marker.unlink()
    torch.manual_seed(0)
    loader = RobustLoader(ds, num_workers=2, persistent_workers=False, timeout=60, **kwargs)
    with pytest.warns(LoaderWarning, match="worker died.*restarting with \\{'num_workers': 1\\}"):
        got = [_ids(b) for b in loader]
    assert marker.exists()  # the fault did fire
    assert got == expected  # every planned batch exactly once, in order
    assert [cause for cause, _ in loader.restarts] == ["death"]


def test_a_hung_worker_times_out_and_the_epoch_completes(tmp_path):
    ds = Faulty(40, tmp_path / "fired", fault_at=13, fault="hang")
    loader = RobustLoader(ds, batch_size=4, num_workers=2, timeout=2)
    start = time.monotonic()
    with pytest.warns(LoaderWarning, match="hung past the timeout"):
        got = [i for b in loader for i in _ids(b)]
    assert got == list(range(40)) and time.monotonic() - start < 60
    assert loader.restarts[0][0] == "hang"


def shm_failing_collate(items):
    if get_worker_info() is not None:  # what a full /dev/shm makes torch raise in a worker
        raise RuntimeError(
            "unable to write to file </torch_4242_123_0>: No space left on device (28)"
        )
    return torch.tensor(items)


def test_a_full_dev_shm_falls_back_to_no_workers_and_names_shm_size(tmp_path):
    loader = RobustLoader(
        Faulty(30, tmp_path / "unused"), batch_size=5, num_workers=2, collate_fn=shm_failing_collate
    )
    with pytest.warns(LoaderWarning, match=r"--shm-size"):
        got = [i for b in loader for i in _ids(b)]
    assert got == list(range(30))
    assert loader.restarts == [("shm", {"num_workers": 0})] and loader.loader.num_workers == 0


def test_errors_of_the_dataset_itself_are_not_retried(tmp_path):
    loader = RobustLoader(
        Faulty(30, tmp_path / "fired", fault_at=7, fault="raise"), batch_size=5, num_workers=2
    )
    with pytest.raises(RuntimeError, match="record 7 is corrupt"):
        list(loader)
    assert loader.restarts == []


def test_the_ladder_steps_down_in_order():
    from recipes.common.loading.robust_loader import _next_rung

    settings = {"num_workers": 8, "prefetch_factor": 2, "pin_memory": True}
    assert _next_rung(None, [], settings, "death") == {"num_workers": 4}
    assert _next_rung(None, [], {**settings, "num_workers": 1}, "death") == {"prefetch_factor": 1}
    assert _next_rung(
        None, [], {"num_workers": 1, "prefetch_factor": 1, "pin_memory": True}, "hang"
    ) == {"pin_memory": False}
    assert _next_rung(
        None, [], {"num_workers": 1, "prefetch_factor": 1, "pin_memory": False}, "hang"
    ) == {"num_workers": 0}
    assert _next_rung(None, [], settings, "shm") == {"num_workers": 0}
    assert _next_rung([{"num_workers": 3}], [], settings, "death") == {"num_workers": 3}


def test_a_reset_connection_counts_as_a_death_once_its_worker_is_reaped():
    """A batch whose sender died while the main process fetched its shared memory raises
    ConnectionResetError a moment before the worker can be reaped (the socket closes first):
    that error is a death when a worker exits within the poll, and not one otherwise."""
    import multiprocessing
    from types import SimpleNamespace

    from recipes.common.loading.robust_loader import _worker_died

    ctx = multiprocessing.get_context("fork")
    dying, living = (
        ctx.Process(target=time.sleep, args=(0.3,)),
        ctx.Process(target=time.sleep, args=(30,)),
    )
    dying.start()
    living.start()
    try:
        assert _worker_died(SimpleNamespace(_workers=[living, dying])) == "death"
        start = time.monotonic()
        assert _worker_died(SimpleNamespace(_workers=[living])) is None
        assert time.monotonic() - start < 5
    finally:
        living.kill()
        living.join()
        dying.join()


class SaysTimedOut(Dataset):
    """A dataset whose own error mentions a timeout (a subprocess or HTTP timeout in a worker)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 13:
            raise RuntimeError("the backend timed out after 30 s")
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_error_that_says_timed_out_is_raised_not_swallowed(workers):
    """An error of the dataset's own is never taken for the loader's poll or a hang: the batch
    would be lost without a word (found by the adversarial review of issue 20)."""
    got = []
    with pytest.raises(RuntimeError, match="backend timed out after 30 s"):
        for batch in RobustLoader(SaysTimedOut(), batch_size=4, num_workers=workers, timeout=5):
            got += batch.tolist()
    assert got == list(range(12))


def _persistent_workers(loader: RobustLoader) -> list:
    """The live worker processes of a RobustLoader's persistent workers (between epochs too)."""
    iterator = loader.loader._iterator
    return [w for w in getattr(iterator, "_workers", []) if w.is_alive()]


def _kill_one(loader: RobustLoader) -> None:
    worker = _persistent_workers(loader)[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)


@pytest.mark.parametrize(
    "kind, moment",
    [
        ("shuffle", "between_epochs"),
        ("sharded", "during_validation"),
        *(
            pytest.param(k, m, marks=pytest.mark.slow)
            for k, m in [  # the other combinations: the full suite
                ("sharded", "between_epochs"),
                ("shuffle", "after_last_batch"),
                ("sharded", "after_last_batch"),
                ("shuffle", "during_validation"),
            ]
        ),
    ],
)
def test_a_persistent_worker_killed_outside_an_iteration_costs_a_restart(kind, moment, tmp_path):
    """Issue #27: a persistent worker SIGKILLed while the loop is elsewhere (validating,
    checkpointing) was found by DataLoader's `_reset` inside `iter()`, beyond any retry."""

    def build_with(num_workers=2):
        torch.manual_seed(0)
        if kind == "sharded":
            sizes = [9, 14, 6, 11, 8, 12]
            ds = ShardedIterableDataset(
                make_int_shards(tmp_path / "shards", sizes),
                read_ints,
                shard_lengths=sizes,
                seed=2,
                rank=0,
                world_size=1,
            )
            return RobustLoader(
                ds, batch_size=4, num_workers=num_workers, persistent_workers=True, timeout=60
            ), ds
        return RobustLoader(
            list(range(40)),
            batch_size=4,
            shuffle=True,
            num_workers=num_workers,
            persistent_workers=True,
            tuned=False,
            timeout=60,
        ), None

    build = build_with

    def epochs(loader, ds, kill):
        got, last = [], 15 if kind == "sharded" else 10
        for epoch in range(3):
            if ds is not None:
                ds.set_epoch(epoch)
            iterator, batches = iter(loader), []
            for batch in iterator:
                batches.append(_ids(batch))
                if epoch == 1 and moment == "after_last_batch" and len(batches) == last and kill:
                    _kill_one(
                        loader
                    )  # the epoch's last batch is out; StopIteration is still to come
            got.append(batches)
            if epoch == 0 and kill and moment == "between_epochs":
                _kill_one(loader)
            if epoch == 0 and moment == "during_validation":
                validation = make_loader(list(range(12)), batch_size=4, num_workers=1)
                for step, _ in enumerate(validation):
                    if step == 1 and kill:
                        _kill_one(loader)
                        time.sleep(0.2)  # SIGCHLD arrives while the validation loader runs
        return got

    expected = epochs(*build(), kill=False)
    loader, ds = build()
    with pytest.warns(LoaderWarning, match="worker died"):
        got = epochs(loader, ds, kill=True)
    for epoch, batches in enumerate(got):  # every sample exactly once per epoch, counted
        assert Counter(i for b in batches for i in b) == Counter(
            i for b in expected[epoch] for i in b
        )
    if (
        kind == "sharded"
    ):  # an iterable's epoch order follows the workers it begins with: one, after the restart
        one_worker = epochs(*build_with(num_workers=1), kill=False)
        assert (
            all(g in (e, o) for g, e, o in zip(got, expected, one_worker, strict=True))
            and got != expected
        )
    else:
        assert got == expected  # a map-style order never depends on the workers
    assert [cause for cause, _ in loader.restarts] == ["death"]
    loader.close()


class ThreadIds(torch.utils.data.Dataset):
    """Item i is i, with batches made in threads (`ThreadBatched`: a memory-speed cache's kind)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return int(i)

    def thread_batches(self):
        return True

    def read_batch(self, indices, rng):
        return torch.tensor([int(i) for i in indices])


@pytest.mark.parametrize("path", ["threads", "auto"])
def test_a_thread_capable_dataset_keeps_the_thread_path(path):
    """Review of #27: RobustLoader always passed `timeout=`, which path='threads' refuses and
    which made path='auto' choose worker processes for a cache the thread path serves faster."""
    torch.manual_seed(0)
    loader = RobustLoader(ThreadIds(), batch_size=4, shuffle=True, path=path)
    assert loader.loader.recipe.reasons["path"].startswith("threads") or path == "threads"
    assert loader.loader.num_workers == 0
    assert Counter(i for b in loader for i in _ids(b)) == Counter(range(40))
