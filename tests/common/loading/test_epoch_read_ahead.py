"""The thread paths read the next epoch's first batches while the loop takes the last ones
(`epoch_read_ahead.py`): each batch made once, and always the one its epoch would have made
(checked against a run that foresees nothing), whatever changes between epochs."""

import array
import collections
import dataclasses
import multiprocessing
import threading
import time
import types
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, SequentialSampler

import recipes.common.loading.thread_loader as thread_loader
from recipes.common import IsolatedLoader, ThreadLoader
from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler

LOADERS = {"threads": ThreadLoader, "isolated": IsolatedLoader}


class Counted:
    """Thread-batched items whose reads are counted in shared memory (the isolated child's too);
    each batch carries its indices and a draw of its generator (its seed, epoch and position)."""

    def __init__(self, n: int = 40):
        self.n = n
        self.reads = multiprocessing.Value("q", 0, lock=False)  # shared with the forked child

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)

    def thread_batches(self):
        return True

    def read_ahead_key(self):
        return self.n  # its batches depend on nothing else

    def read_batch(self, indices, rng):
        self.reads.value += 1  # one pool thread: no race
        return torch.tensor(indices), torch.from_numpy(rng.integers(0, 2**31, len(indices)))


def _order(kind, dataset):
    if kind == "shuffle":
        return {"shuffle": True, "generator": torch.Generator().manual_seed(5)}
    if kind == "sequential":
        return {"sampler": SequentialSampler(dataset)}
    if kind == "elastic":
        return {"sampler": ElasticDistributedSampler(dataset, num_replicas=2, rank=1, seed=3)}
    return {"sampler": DistributedSampler(dataset, num_replicas=2, rank=0, seed=3)}


def _epochs(loader, epochs, settle=None):
    """Every epoch's batches as (ids, draws) lists; `settle(epoch)` runs after each epoch's last
    batch."""
    got = []
    for epoch in range(epochs):
        if (
            isinstance(loader.sampler, DistributedSampler)
            and type(loader.sampler) is DistributedSampler
        ):
            loader.sampler.set_epoch(epoch)
        batches = [(ids.tolist(), draws.tolist()) for ids, draws in loader]
        got.append(batches)
        if settle is not None:
            settle(epoch)
    return got


def _unforeseen(monkeypatch, make, epochs, between=None):
    """The run that foresees nothing: (its epochs, its reads); `between(loader)` makes the settle of
    `_epochs`."""
    with monkeypatch.context() as patch:
        patch.setattr(thread_loader, "forecast", lambda loader, epoch: None)
        loader = make()
        try:
            return _epochs(loader, epochs, between and between(loader)), loader.dataset.reads.value
        finally:
            loader.close()


@pytest.mark.parametrize("path", ["threads", "isolated"])
@pytest.mark.parametrize("kind", ["shuffle", "sequential", "elastic", "distributed"])
def test_the_next_epochs_first_batches_are_made_ahead_once_and_equal_an_unforeseen_run(
    monkeypatch, path, kind
):
    def make():
        dataset = Counted(40)
        return LOADERS[path](
            dataset, batch_size=4, threads=1, prefetch=2, seed=9, **_order(kind, dataset)
        )

    expected, reads_without = _unforeseen(monkeypatch, make, 4)
    per_epoch = len(expected[0])
    assert reads_without == 4 * per_epoch

    loader = make()
    seen = []

    def settle(
        epoch,
    ):  # the pool's work done; what it made beyond the loop's batches is the next epoch's
        reads, deadline = loader.dataset.reads, time.monotonic() + 5
        while (
            reads.value < (epoch + 1) * per_epoch + 2 * (epoch >= 1) and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        time.sleep(0.1)  # time for a read too many
        seen.append(reads.value - (epoch + 1) * per_epoch)

    try:
        assert _epochs(loader, 4, settle) == expected
    finally:
        loader.close()
    # nothing ahead of the second epoch (a loader iterated once makes nothing it does not use), then
    # the next epoch's first `prefetch` batches, each used: no batch made twice
    assert seen == [0, 2, 2, 2]


class Unkeyed(Counted):
    """Says nothing of what its batches depend on: an `offset` the loop changes in place."""

    read_ahead_key = None

    def __init__(self, n: int = 40):
        super().__init__(n)
        self.settings = {"offset": 0}

    def read_batch(self, indices, rng):
        self.reads.value += 1
        return torch.tensor(indices) + self.settings["offset"], torch.from_numpy(
            rng.integers(0, 2**31, len(indices))
        )


def test_a_dataset_without_a_read_ahead_key_is_read_in_its_epoch_and_changes_in_place_are_seen():
    dataset = Unkeyed(16)
    loader = ThreadLoader(
        dataset,
        batch_size=4,
        threads=1,
        prefetch=2,
        seed=1,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    for epoch in range(4):
        dataset.settings["offset"] = 1000 * epoch  # in place: no attribute set anew
        ids = torch.cat([i for i, _ in loader])
        assert sorted((ids - 1000 * epoch).tolist()) == list(range(16))
        time.sleep(0.05)
        assert dataset.reads.value == 4 * (epoch + 1)  # nothing made ahead


class SideEffects(DistributedSampler):
    """Its set_epoch also moves the dataset on: a copy's set_epoch would too."""

    def set_epoch(self, epoch):
        super().set_epoch(epoch)
        self.dataset.epoch = epoch


def test_a_sampler_subclass_is_not_foreseen():
    dataset = Counted(16)
    dataset.epoch = 0
    sampler = SideEffects(dataset, num_replicas=1, rank=0)
    loader = ThreadLoader(dataset, batch_size=4, threads=1, prefetch=2, seed=1, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert len(list(loader)) == 4 and dataset.epoch == epoch
    assert dataset.reads.value == 12


@pytest.mark.parametrize("path", ["threads", "isolated"])
def test_a_loader_iterated_once_reads_nothing_beyond_its_epoch_whatever_its_epoch(path):
    dataset = Counted(16)
    sampler = ElasticDistributedSampler(dataset, num_replicas=1, rank=0)
    sampler.set_epoch(3)
    loader = LOADERS[path](dataset, batch_size=4, threads=1, prefetch=2, seed=1, sampler=sampler)
    try:
        assert len(list(loader)) == 4
        time.sleep(0.2)
        assert dataset.reads.value == 4
    finally:
        loader.close()


class Locked(Counted):
    """Each read holds a lock of the dataset's (a file handle's, h5py's): a child forked while a
    thread of this process holds it would wait for it forever."""

    def __init__(self, n: int = 32):
        super().__init__(n)
        self.lock = threading.Lock()

    def read_batch(self, indices, rng):
        with self.lock:
            time.sleep(0.05)
        return super().read_batch(indices, rng)


def test_the_child_is_never_forked_while_this_process_reads_ahead():
    """The probe moves a waiting loop to threads of this process, a busy one back to the child:
    the epoch before that move ends with the next epoch's batches being read in this process."""
    loader = IsolatedLoader(
        Locked(),
        batch_size=4,
        threads=1,
        prefetch=4,
        seed=0,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        adaptive=True,
        timeout=10,
    )

    def busy(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    try:
        where = []
        for step in (time.sleep, time.sleep, busy, busy):
            count = 0
            for _ in loader:
                step(0.02)
                count += 1
            where.append((count, loader.in_process))
        assert where == [(8, False), (8, True), (8, True), (8, False)]
    finally:
        loader.close()


@pytest.mark.parametrize("path", ["threads", "isolated"])
@pytest.mark.parametrize("parts", [1, 2])
def test_a_new_resolution_between_epochs_drops_what_was_made_ahead(path, parts, tmp_path):
    from torch.utils.data import ConcatDataset

    from recipes.testing import make_image_folder
    from recipes.vision import ImageFolderFast, build_image_cache

    images = []
    for part in range(parts):
        image = ImageFolderFast(
            make_image_folder(
                tmp_path / f"images{part}", classes=2, per_class=8 // parts, seed=2 + part
            ),
            size=32,
            train=True,
        )
        build_image_cache(image, tmp_path / f"cache{part}", progress=False)
        images.append(image)
    dataset = images[0] if parts == 1 else ConcatDataset(images)
    loader = LOADERS[path](
        dataset,
        batch_size=4,
        shuffle=True,
        threads=1,
        prefetch=2,
        seed=1,
        generator=torch.Generator().manual_seed(0),
    )
    reference = ThreadLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        threads=1,
        prefetch=2,
        seed=1,
        generator=torch.Generator().manual_seed(0),
    )
    try:
        for epoch, size in enumerate([32, 32, 24, 24, 32]):
            for image in images:
                image.set_resolution(size)  # progressive resizing: in shared memory, in place
            got = list(loader)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(thread_loader, "forecast", lambda loader, epoch: None)
                want = list(reference)
            assert [x.shape[-2:] for x, _ in got] == [(size, size)] * 4, epoch
            for (x, y), (xe, ye) in zip(got, want, strict=True):
                assert torch.equal(x, xe) and torch.equal(y, ye)
    finally:
        loader.close()
        reference.close()


@pytest.mark.parametrize("path", ["threads", "isolated"])
def test_a_state_loaded_or_another_epoch_set_between_epochs_is_served_not_the_guess(
    monkeypatch, path
):
    def make():
        dataset = Counted(24)
        return LOADERS[path](
            dataset,
            batch_size=4,
            threads=1,
            prefetch=2,
            seed=9,
            sampler=ElasticDistributedSampler(dataset, num_replicas=1, rank=0, seed=1),
        )

    expected, _ = _unforeseen(monkeypatch, make, 6)
    loader = make()
    try:
        assert _epochs(loader, 2) == expected[:2]  # the third epoch's first batches are made now
        loader.sampler.set_epoch(4)  # the loop jumps to epoch 4
        assert [(i.tolist(), d.tolist()) for i, d in loader] == expected[4]
        saved = make()
        try:
            iterator = iter(saved)
            for _ in range(2):
                next(iterator)
            state = saved.state_dict()  # epoch 0 after two batches
        finally:
            saved.close()
        loader.load_state_dict(state)
        assert [(i.tolist(), d.tolist()) for i, d in loader] == expected[0][2:]
        assert [(i.tolist(), d.tolist()) for i, d in loader] == expected[1]
    finally:
        loader.close()


def test_a_closed_loader_drops_what_was_made_ahead_and_starts_again_exactly(monkeypatch):
    def make():
        dataset = Counted(24)
        return IsolatedLoader(
            dataset,
            batch_size=4,
            threads=1,
            prefetch=2,
            seed=9,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
        )

    expected, _ = _unforeseen(monkeypatch, make, 4)
    loader = make()
    try:
        assert _epochs(loader, 2) == expected[:2]
        loader.close()  # the child ends with the next epoch's first batches asked of it
        assert _epochs(loader, 2) == expected[2:]
    finally:
        loader.close()


class Keyed(Counted):
    """A key that raises, or that holds a tensor (compared by identity inside a tuple)."""

    def __init__(self, n: int, key):
        super().__init__(n)
        self.key = key

    def read_ahead_key(self):
        if self.key == "raises":
            raise RuntimeError("no key today")
        return ("size", torch.tensor([32]))


@pytest.mark.parametrize("path", ["threads", "isolated"])
@pytest.mark.parametrize("key", ["raises", "tensor"])
def test_a_key_that_raises_or_holds_a_tensor_means_no_read_ahead_and_no_error(path, key):
    dataset = Keyed(24, key)
    loader = LOADERS[path](
        dataset,
        batch_size=4,
        threads=1,
        prefetch=2,
        seed=1,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    try:
        for epoch in range(4):
            counts = Counter(torch.cat([i for i, _ in loader]).tolist())
            assert sorted(counts) == list(range(24)) and set(counts.values()) == {1}
            time.sleep(0.05)
            assert dataset.reads.value == 6 * (epoch + 1)
    finally:
        loader.close()


def test_a_fork_waits_for_another_loaders_reads_ahead():
    """A validation ThreadLoader ends its second pass reading the third's first batches while the
    training IsolatedLoader forks its child: a lock their datasets share is never copied held."""
    lock = threading.Lock()
    val, train = Locked(16), Locked(32)
    val.lock = train.lock = lock
    val.read_ahead_key = lambda: 16
    validation = ThreadLoader(val, batch_size=4, threads=1, prefetch=2, seed=0)
    training = IsolatedLoader(
        train,
        batch_size=4,
        threads=1,
        prefetch=2,
        seed=0,
        timeout=10,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    try:
        for _ in range(2):
            assert len(list(validation)) == 4
        assert len(list(training)) == 8  # forked now, beside the validation loader's reads ahead
        assert len(list(validation)) == 4  # and those reads were the next pass's, used
    finally:
        validation.close()
        training.close()


class LockedItems(torch.utils.data.Dataset):
    def __init__(self, lock):
        self.lock = lock

    def __len__(self):
        return 8

    def __getitem__(self, i):
        with self.lock:
            return i


def test_worker_processes_start_after_another_loaders_reads_ahead():
    """The same for DataLoader's workers (`StatefulLoader`, forked): an evaluation with workers
    after a ThreadLoader's pass never inherits a lock held by one of its reads."""
    from recipes.common import StatefulLoader

    lock = threading.Lock()
    val = Locked(16)
    val.lock = lock
    val.read_ahead_key = lambda: 16
    threads = ThreadLoader(val, batch_size=4, threads=1, prefetch=2, seed=0)
    workers = StatefulLoader(
        LockedItems(lock),
        batch_size=4,
        num_workers=1,
        timeout=10,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    try:
        for _ in range(2):
            assert len(list(threads)) == 4
        assert torch.cat(list(workers)).tolist() == list(range(8))
    finally:
        threads.close()


class Sized(Counted):
    """Each item is its index plus a size in shared memory (as `set_resolution`'s, which the
    isolated child sees too), read as the read starts and as it ends: a read made under a
    setting the loop set back shows it."""

    def __init__(self, n: int = 24):
        super().__init__(n)
        self.size = multiprocessing.Value("q", 1, lock=False)

    def read_ahead_key(self):
        return ("size", int(self.size.value))

    def read_batch(self, indices, rng):
        first = int(self.size.value)
        time.sleep(0.03)
        ids, draws = super().read_batch(indices, rng)
        return ids * 100 + first * 10 + int(self.size.value), draws


@pytest.mark.slow  # about 4 s per path: in the full suite (CI)
@pytest.mark.parametrize("path", ["threads", "isolated"])
def test_a_setting_changed_between_epochs_and_set_back_is_never_served(monkeypatch, path):
    """Between epochs the loop evaluates at another size, then sets its own back: the reads ahead
    made meanwhile are read again in their epoch, under the setting the epoch has."""

    def make():
        return LOADERS[path](
            Sized(),
            batch_size=4,
            threads=1,
            prefetch=3,
            seed=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(4),
        )

    def evaluate_between(loader):
        def settle(epoch):
            loader.dataset.size.value = 2
            time.sleep(0.3)  # every read ahead made (or started) at size 2
            loader.dataset.size.value = 1

        return settle

    expected, _ = _unforeseen(monkeypatch, make, 4, evaluate_between)
    assert all(value % 100 == 11 for epoch in expected for ids, _ in epoch for value in ids)
    loader = make()
    try:
        assert _epochs(loader, 4, evaluate_between(loader)) == expected
    finally:
        loader.close()


def test_a_process_forked_beside_reads_ahead_does_not_wait_for_them():
    """A user's own fork (an evaluation job) right after an epoch: the forked process has none of
    the pool's threads, so nothing of theirs to wait for before its own forks and workers."""
    import os

    from recipes.common.loading.epoch_read_ahead import settle_reads_ahead

    loader = ThreadLoader(Locked(32), batch_size=4, threads=1, prefetch=4, seed=0)
    loader.dataset.lock = threading.Lock()
    try:
        for _ in range(2):
            assert (
                len(list(loader)) == 8
            )  # the second ends with the third's first batches asked for
        pid = os.fork()
        if pid == 0:
            settle_reads_ahead()
            os._exit(0)
        deadline = time.monotonic() + 10
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        loader.close()


@dataclasses.dataclass(frozen=True)
class Holding:
    values: object


@pytest.mark.parametrize(
    "key",
    [
        [1, 2],
        {"size": 1},
        {1, 2},
        Holding(np.zeros(2)),
        (1, Holding([3])),
        collections.deque([1]),
        array.array("i", [1]),
        types.SimpleNamespace(size=1),
        (1, object()),
        torch.tensor([1]),
    ],
    ids=repr,
)
def test_a_key_holding_what_could_change_in_place_means_no_read_ahead(key):
    from recipes.common.loading.epoch_read_ahead import ByIdentity, read_ahead_key

    dataset = Counted(8)
    dataset.read_ahead_key = lambda: key
    assert read_ahead_key(dataset) is None
    cache = object()
    dataset.read_ahead_key = lambda: (
        1,
        Holding((2, 3.0)),
        "a",
        None,
        float("nan"),
        np.int64(4),
        ByIdentity(cache),
    )
    assert read_ahead_key(dataset) == read_ahead_key(
        dataset
    )  # values, NaN equal to NaN, the same object
    before = read_ahead_key(dataset)
    cache = object()  # another object where the key names one by identity
    assert read_ahead_key(dataset) != before


@dataclasses.dataclass
class Settings:
    offset: int = 0


class Configured(Counted):
    """Batches that depend on a (mutable) dataclass, changed in place between epochs."""

    def __init__(self, n: int = 24):
        super().__init__(n)
        self.settings = Settings()

    def read_ahead_key(self):
        return self.settings

    def read_batch(self, indices, rng):
        ids, draws = super().read_batch(indices, rng)
        return ids + self.settings.offset, draws


def test_a_dataclass_in_the_key_changed_in_place_is_seen(monkeypatch):
    def make():
        return ThreadLoader(
            Configured(),
            batch_size=4,
            threads=1,
            prefetch=2,
            seed=1,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )

    def bump(loader):
        def settle(epoch):
            time.sleep(0.1)  # the reads ahead made under the old offset
            loader.dataset.settings.offset += 1000

        return settle

    expected, _ = _unforeseen(monkeypatch, make, 4, bump)
    loader = make()
    try:
        assert _epochs(loader, 4, bump(loader)) == expected
    finally:
        loader.close()


def test_image_folder_targets_changed_in_place_between_epochs_are_served(tmp_path):
    """Pseudo-labelling: the labels rewritten in place after each epoch reach the next one's
    first batches (ImageFolderFast's key has a checksum of its targets)."""
    from recipes.testing import make_image_folder
    from recipes.vision import ImageFolderFast

    dataset = ImageFolderFast(
        make_image_folder(tmp_path, classes=2, per_class=8, seed=3), size=24, train=True
    )
    loader = ThreadLoader(
        dataset,
        batch_size=4,
        threads=1,
        prefetch=2,
        seed=1,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    try:
        for epoch in range(4):
            labels = torch.cat([y for _, y in loader])
            assert set(labels.tolist()) <= {epoch * 10, epoch * 10 + 1}, epoch
            time.sleep(0.1)  # the reads ahead made under the old labels
            dataset.targets[:] = dataset.targets % 10 + (epoch + 1) * 10
    finally:
        loader.close()


def test_image_folder_cache_labels_replaced_between_epochs_are_served(tmp_path):
    """With a cache attached the labels come from it: a relabelled array set on the cache between
    epochs reaches the next epoch's first batches (the key's checksum of the cache's labels). In
    this process: an isolated child keeps the cache it was forked with, read-ahead or not."""
    from recipes.testing import make_image_folder
    from recipes.vision import ImageFolderFast, build_image_cache

    dataset = ImageFolderFast(
        make_image_folder(tmp_path / "images", classes=2, per_class=8, seed=3), size=24, train=True
    )
    build_image_cache(dataset, tmp_path / "cache", progress=False)
    loader = ThreadLoader(
        dataset,
        batch_size=4,
        threads=1,
        prefetch=2,
        seed=1,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    try:
        for epoch in range(4):
            labels = torch.cat([y for _, y in loader])
            assert set(labels.tolist()) <= {epoch * 10, epoch * 10 + 1}, epoch
            time.sleep(0.1)  # the reads ahead made under the old labels
            dataset.cache.labels = dataset.cache.labels % 10 + (epoch + 1) * 10
    finally:
        loader.close()


@pytest.mark.parametrize("path", ["threads", "isolated"])
def test_image_folder_with_a_cache_is_served_its_reads_ahead_none_read_again(
    monkeypatch, path, tmp_path
):
    """The common case stays fast: nothing changes, so from the third epoch its first `prefetch`
    batches are the ones made ahead, and no read ahead comes back CHANGED (in the isolated child,
    its key equals the parent's: the cache by identity through the fork, the checksums)."""
    import recipes.common.loading.epoch_read_ahead as ahead
    from recipes.testing import make_image_folder
    from recipes.vision import ImageFolderFast, build_image_cache

    dataset = ImageFolderFast(
        make_image_folder(tmp_path / "images", classes=2, per_class=8, seed=3), size=24, train=True
    )
    build_image_cache(dataset, tmp_path / "cache", progress=False)
    served, changed = (
        [],
        multiprocessing.Value("q", 0, lock=False),
    )  # shared with the isolated child
    result, read = ahead._Ahead.result, ahead.read_if_unchanged

    def counted(made):
        served.append(made)
        return result(made)

    def checked(*args):
        batch = read(*args)
        changed.value += batch is ahead.CHANGED
        return batch

    monkeypatch.setattr(ahead._Ahead, "result", counted)
    monkeypatch.setattr(ahead, "read_if_unchanged", checked)
    loader = LOADERS[path](
        dataset,
        batch_size=4,
        threads=1,
        prefetch=2,
        seed=1,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    try:
        for _ in range(4):
            assert len(list(loader)) == 4
    finally:
        loader.close()
    assert len(served) == 2 * 2 and changed.value == 0  # epochs 2 and 3: `prefetch` batches each
