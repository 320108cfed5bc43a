"""IsolatedLoader (issue 39): the thread path in a child process, batches through shared memory.

Expectations are independent of the path under test: the in-process `ThreadLoader` (itself
checked against torchvision in tests/vision) for the same seed and sampler, the indices the
sampler gives, and an uninterrupted run for every resume."""

import collections
import os
import signal
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from recipes.common import LoaderMonitor, RobustLoader, ThreadLoader, make_loader
from recipes.common.loading.isolated_loader import (
    IsolatedHandOverError,
    IsolatedLoader,
    IsolatedProcessDied,
)
from recipes.testing import make_image_folder
from recipes.vision import ImageFolderFast, build_image_cache


class Records:
    """Thread-batched records: a dict batch of a tensor, a numpy array, strings and a scalar.
    `kill_at` SIGKILLs the child process reading that index, once (a marker file)."""

    def __init__(
        self,
        n: int = 64,
        bad: int | None = None,
        kill_at: int | None = None,
        marker: str | None = None,
        pixels: bool = False,
    ):
        self.n, self.bad, self.kill_at, self.marker, self.pixels = n, bad, kill_at, marker, pixels
        self.parent = os.getpid()  # make_loader's probe reads an item here: never killed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.read_batch([i], None)

    def thread_batches(self):
        return True

    def read_batch(self, indices, rng):
        if self.bad in indices:
            raise ValueError(f"record {self.bad} is damaged: rebuild its cache")
        if (
            self.kill_at in indices
            and os.getpid() != self.parent
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        ids = torch.tensor(indices, dtype=torch.int64)
        batch = {
            "ids": ids,
            "square": np.asarray(indices, np.float32) ** 2,
            "names": [f"r{i}" for i in indices],
            "size": len(indices),
            "mask": ids % 2 == 0,
        }
        if self.pixels:  # 32 KiB an item: a batch large enough to travel in its slot
            batch["pixels"] = (
                (ids % 251).to(torch.uint8).view(-1, 1, 1).expand(-1, 128, 256).contiguous()
            )
        return batch


def _ids(batches) -> list[list[int]]:
    return [b["ids"].tolist() for b in batches]


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    root = make_image_folder(tmp_path_factory.mktemp("iso"), classes=3, per_class=16, seed=4)
    ds = ImageFolderFast(root, size=48, train=True)
    build_image_cache(ds, tmp_path_factory.mktemp("iso-cache"), progress=False)
    return ds


def test_train_crops_equal_the_in_process_thread_path_over_epochs(cached):
    threads = ThreadLoader(
        cached, batch_size=8, shuffle=True, seed=3, generator=torch.Generator().manual_seed(1)
    )
    isolated = IsolatedLoader(
        cached, batch_size=8, shuffle=True, seed=3, generator=torch.Generator().manual_seed(1)
    )
    for _ in range(2):
        expected, got = list(threads), list(isolated)
        assert len(got) == len(expected) == 6
        for (xi, yi), (xe, ye) in zip(got, expected, strict=True):
            assert torch.equal(xi, xe) and torch.equal(yi, ye)
            assert xi.stride() == xe.stride() and xi.dtype == torch.uint8  # channels-last kept
    pid = isolated.child_pid
    assert pid is not None
    isolated.close()
    assert isolated.child_pid is None
    with pytest.raises(ProcessLookupError):
        for _ in range(200):  # reaped by close
            os.kill(pid, 0)
            import time

            time.sleep(0.01)


def test_dict_batches_with_numpy_strings_and_scalars_cross_intact():
    loader = make_loader(Records(20), batch_size=6, path="isolated")
    batches = list(loader)
    assert [b["ids"].tolist() for b in batches] == [
        list(range(i, min(i + 6, 20))) for i in range(0, 20, 6)
    ]
    last = batches[-1]
    assert isinstance(last["square"], np.ndarray) and last["square"].tolist() == [18.0**2, 19.0**2]
    assert (
        last["names"] == ["r18", "r19"] and last["size"] == 2 and last["mask"].dtype == torch.bool
    )
    assert last["mask"].tolist() == [True, False]


def test_batches_the_loop_keeps_are_never_overwritten():
    loader = make_loader(
        Records(96, pixels=True),
        batch_size=4,
        shuffle=True,
        path="isolated",
        generator=torch.Generator().manual_seed(2),
    )
    kept = list(loader)  # every batch of the epoch alive at once
    rows = [b["pixels"][1] for b in list(loader)]  # the next epoch: only a row of each batch kept
    assert Counter(i for b in kept for i in b["ids"].tolist()) == Counter(range(96))
    for b in kept:
        assert b["square"].tolist() == [float(i) ** 2 for i in b["ids"].tolist()]
        assert b["pixels"][:, 5, 7].tolist() == [i % 251 for i in b["ids"].tolist()]
    assert all(int(r.min()) == int(r.max()) for r in rows) and len(rows) == 24
    assert loader.ring_slots >= len(kept) + len(rows)  # the ring grew rather than reuse a held slot
    del kept, b
    slots = loader.ring_slots
    for _ in range(3):
        for _b in loader:  # dropped batch by batch: the slots are reused
            pass
    assert loader.ring_slots == slots


def test_labels_the_loop_keeps_do_not_keep_their_batch_slot():
    loader = make_loader(Records(96, pixels=True), batch_size=4, path="isolated")
    labels = [b["ids"] for b in loader]  # a metrics list: small tensors travel apart from the slot
    assert torch.cat(labels).tolist() == list(range(96))
    assert loader.ring_slots <= 2 * loader.prefetch + 2


@pytest.mark.parametrize("cut", [0, 5, 11])
def test_a_resume_mid_epoch_on_either_path_finishes_the_uninterrupted_run(cut):
    def build(path):
        torch.manual_seed(0)
        return make_loader(Records(48), batch_size=4, shuffle=True, path=path)

    whole = build("threads")
    expected = [_ids(whole) for _ in range(3)]
    first = build("isolated")
    list(first)
    iterator = iter(first)
    prefix = [next(iterator)["ids"].tolist() for _ in range(cut)]
    state = first.state_dict()
    del iterator
    first.close()
    for path in ("isolated", "threads"):  # a state of the isolated path resumes on either
        resumed = build(path)
        torch.manual_seed(5)  # the resumed process's own seed plays no part
        resumed.load_state_dict(state)
        assert prefix + _ids(resumed) == expected[1], path
        assert _ids(resumed) == expected[2], path


def test_a_dataset_error_in_the_child_reaches_the_loop_typed_and_its_batch_is_used_up():
    loader = make_loader(Records(24, bad=9), batch_size=4, path="isolated")
    iterator = iter(loader)
    got = [next(iterator)["ids"].tolist() for _ in range(2)]
    with pytest.raises(ValueError, match="record 9 is damaged"):
        next(iterator)
    got += _ids(iterator)  # the loop carries on past the bad batch, as on the thread path
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]


def test_a_killed_child_is_reported_and_the_state_resumes_at_the_first_batch_not_received(tmp_path):
    marker = str(tmp_path / "killed")
    loader = make_loader(
        Records(40, kill_at=21, marker=marker), batch_size=4, path="isolated", prefetch=1
    )
    iterator = iter(loader)
    got = [next(iterator)["ids"].tolist() for _ in range(5)]
    with pytest.raises(IsolatedProcessDied, match="killed by signal 9"):
        next(iterator)
    resumed = make_loader(Records(40), batch_size=4, path="isolated")
    resumed.load_state_dict(loader.state_dict())
    assert got + _ids(resumed) == [list(range(i, i + 4)) for i in range(0, 40, 4)]


@pytest.mark.parametrize("kill_at", [0, 17, 39])
def test_robust_loader_survives_the_child_killed_at_any_moment_each_sample_once(tmp_path, kill_at):
    marker = str(tmp_path / "killed")
    torch.manual_seed(3)
    robust = RobustLoader(
        Records(40, kill_at=kill_at, marker=marker), batch_size=4, shuffle=True, path="isolated"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        received = [i for b in robust for i in b["ids"].tolist()]
    assert Counter(received) == Counter(range(40))  # counted: each sample exactly once
    assert os.path.exists(marker) and robust.restarts == [("death", {"path": "isolated"})]
    assert any("restarting" in str(w.message) for w in caught)
    assert isinstance(robust.loader, IsolatedLoader)


def test_a_new_resolution_between_epochs_reaches_the_child(cached):
    loader = IsolatedLoader(cached, batch_size=8, shuffle=False, seed=1)
    first = next(iter(loader))[0]
    pid = loader.child_pid
    assert (
        next(iter(loader))[0].shape == first.shape and loader.child_pid == pid
    )  # one child over epochs
    old = cached.resolution
    try:
        cached.set_resolution(32)  # progressive resizing (shared memory, as workers see it)
        assert next(iter(loader))[0].shape[-2:] == (32, 32)
    finally:
        cached.set_resolution(old)
        loader.close()


def test_an_attribute_set_anew_between_epochs_forks_a_child_that_sees_it():
    ds = Records(32)
    loader = make_loader(ds, batch_size=4, path="isolated")
    assert len(_ids(loader)) == 8
    pid = loader.child_pid
    ds.bad = 5  # what the child forked with no longer holds: the next epoch forks anew
    with pytest.raises(ValueError, match="record 5 is damaged"):
        list(loader)
    assert loader.child_pid != pid


def test_make_loader_isolates_the_thread_path_for_long_epochs_and_says_why(cached):
    long = make_loader(Records(64), batch_size=4)
    assert isinstance(long, IsolatedLoader) and long.recipe.settings["path"] == "isolated"
    assert "one child process (IsolatedLoader)" in long.recipe.reasons["path"]
    short = make_loader(Records(60), batch_size=4)  # 15 batches an epoch
    assert type(short) is ThreadLoader and "fewer than 16" in short.recipe.reasons["path"]
    assert type(make_loader(Records(64), batch_size=4, path="threads")) is ThreadLoader
    with pytest.raises(
        ValueError, match=r"path='isolated' .* \['num_workers'\] configure worker processes"
    ):
        make_loader(Records(64), batch_size=4, path="isolated", num_workers=2)
    assert make_loader(Records(64), batch_size=4, path="isolated", timeout=5).timeout == 5


def test_loader_monitor_reads_the_isolated_path():
    monitor = LoaderMonitor(
        make_loader(Records(64), batch_size=4, path="isolated"), warn_wait_fraction=1.0
    )
    assert sum(len(b["ids"]) for b in monitor) == 64
    assert monitor.epochs[0]["batches"] == 16


Pair = collections.namedtuple("Pair", "ids pixels")


class Leaves(Records):
    """Records whose batch is `make(batch)`: another structure, or a leaf the thread path yields."""

    def __init__(self, n, make):
        super().__init__(n, pixels=True)
        self.make = make

    def read_batch(self, indices, rng):
        return self.make(super().read_batch(indices, rng))


@pytest.mark.parametrize(
    "make",
    [
        lambda b: Pair(b["ids"], b["pixels"]),
        lambda b: collections.OrderedDict(ids=b["ids"], pixels=b["pixels"], zero_d=np.array(2.5)),
        lambda b: {
            "ids": b["ids"],
            "pixels": b["pixels"].permute(0, 2, 1),
            "text": np.array(["a", "b"]),
            "grad": b["ids"].float().requires_grad_(True),
        },
    ],
    ids=["namedtuple", "OrderedDict", "layouts"],
)
def test_structures_and_leaves_cross_as_the_thread_path_yields_them(make):
    threads = list(make_loader(Leaves(24, make), batch_size=4, path="threads"))
    isolated = list(make_loader(Leaves(24, make), batch_size=4, path="isolated"))
    for a, b in zip(threads, isolated, strict=True):
        assert type(a) is type(b)
        for key in a._fields if isinstance(a, tuple) else a:
            x, y = (getattr(a, key), getattr(b, key)) if isinstance(a, tuple) else (a[key], b[key])
            assert type(x) is type(y) and x.shape == y.shape and x.dtype == y.dtype
            if isinstance(x, torch.Tensor):
                assert torch.equal(x.detach(), y.detach()) and x.stride() == y.stride()
                assert x.requires_grad == y.requires_grad
            else:
                assert np.array_equal(x, y)


def test_a_batch_that_cannot_cross_is_a_typed_error_not_a_hang_and_not_counted():
    import threading

    loader = make_loader(
        Leaves(24, lambda b: {**b, "lock": threading.Lock()}),
        batch_size=4,
        path="isolated",
        timeout=60,
    )
    iterator = iter(loader)
    with pytest.raises(IsolatedHandOverError, match="cannot pickle"):
        next(iterator)
    assert (
        loader.state_dict()["batches_yielded"] == 0
    )  # not behind the loop: a resume makes it again


def test_a_dataset_error_carries_the_childs_traceback():
    loader = make_loader(Records(24, bad=9), batch_size=4, path="isolated")
    with pytest.raises(ValueError) as caught:
        list(loader)
    assert any(
        "child process" in note and "read_batch" in note
        for note in getattr(caught.value, "__notes__", [])
    )


def test_a_shared_memory_failure_in_the_child_is_resumed_by_robust_loader_each_sample_once(
    monkeypatch,
):
    import errno

    import recipes.common.loading.batch_ring as ring

    parent, real, calls = os.getpid(), ring.new_segment, [0]

    def flaky(size):  # the child's third new slot fails, as a full memory cgroup would make it
        calls[0] += 1
        if calls[0] == 3 and os.getpid() != parent:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(size)

    monkeypatch.setattr(ring, "new_segment", flaky)
    robust = RobustLoader(Records(64, pixels=True), batch_size=4, path="isolated", threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = Counter(i for b in robust for i in b["ids"].tolist())
    # each child fails at its third slot: a new child, then the threads of this process
    assert got == Counter(range(64))
    assert robust.restarts == [("shm", {"path": "isolated"}), ("shm", {"path": "threads"})]


def test_a_loader_dropped_without_close_ends_its_child():
    import gc
    import time

    gc.disable()  # freed by reference counting alone, not by a collection
    try:
        loader = make_loader(Records(64), batch_size=4, path="isolated")
        next(iter(loader))
        pid = loader.child_pid
        del loader
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        gc.enable()


def _alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_the_child_outlives_the_thread_that_forked_it():
    import threading

    loader = make_loader(Records(64), batch_size=4, path="isolated")
    iterators = []
    thread = threading.Thread(
        target=lambda: iterators.append((lambda it: (it, next(it)))(iter(loader)))
    )
    thread.start()
    thread.join()
    iterator, first = iterators[0]
    rest = [b["ids"].tolist() for b in iterator]  # the epoch goes on in the main thread
    assert first["ids"].tolist() + [i for b in rest for i in b] == list(range(64))
    loader.close()


@pytest.mark.parametrize("path", ["threads", "isolated"])
@pytest.mark.parametrize("kind", ["buckets", "elastic"])
def test_a_resume_by_a_sampler_that_resumes_itself_keeps_each_batchs_draws(path, kind):
    """A positioned sampler (LengthBucketSampler, ElasticDistributedSampler) starts the rest by
    itself: the batches' draws follow their epoch positions, as in the uninterrupted run."""
    from recipes.common.sampling.bucketing import LengthBucketSampler
    from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler

    class Draws(Records):
        def read_batch(self, indices, rng):
            draw = (
                0 if rng is None else int(rng.integers(0, 10**6))
            )  # make_loader's probe passes none
            return {"ids": torch.tensor(indices), "draw": torch.tensor(draw)}

    def build():
        if kind == "buckets":
            return make_loader(
                Draws(40),
                batch_sampler=LengthBucketSampler(np.arange(40) % 5 + 1, batch_size=4, seed=1),
                path=path,
                seed=7,
            )
        return make_loader(
            Draws(40),
            batch_size=4,
            sampler=ElasticDistributedSampler(range(40), num_replicas=2, rank=0, seed=1),
            path=path,
            seed=7,
        )

    whole = [(b["ids"].tolist(), int(b["draw"])) for b in build()]
    first = build()
    iterator = iter(first)
    prefix = [(b["ids"].tolist(), int(b["draw"])) for b in (next(iterator), next(iterator))]
    state = first.state_dict()
    del iterator
    resumed = build()
    resumed.load_state_dict(state)
    assert prefix + [(b["ids"].tolist(), int(b["draw"])) for b in resumed] == whole


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


# two image folders and caches (about 4 s): the damage checks themselves run in the fast tier
@pytest.mark.slow
@pytest.mark.parametrize("train", [True, False])
def test_damage_is_never_served_on_the_isolated_path(tmp_path, train):
    """The damage checks hold in the child: a flipped byte found at its first read there (a fork
    starts with nothing verified), a file rewritten after the cache was opened found at the
    child's own reopen; each error names the file."""
    from recipes.vision import ImageCacheError

    root = make_image_folder(tmp_path / "images", classes=2, per_class=8, seed=6)
    ds = ImageFolderFast(root, size=32, train=train)
    build_image_cache(ds, tmp_path / "cache", progress=False)
    path = ds.cache.path / "images.bin" if train else ds.eval_view.path
    offset = int(ds.cache.offsets[5]) + 7 if train else 5 * 32 * 32 * 3 + 100
    opened = ImageFolderFast(root, size=32, train=train, cache_dir=tmp_path / "cache")
    list(make_loader(opened, batch_size=4, path="threads"))  # every item read and verified here
    _flip(path, offset)
    with pytest.raises(ImageCacheError, match=rf"{path.name} changed after the cache was opened"):
        list(make_loader(opened, batch_size=1, path="isolated"))
    fresh = ImageFolderFast(
        root, size=32, train=train, cache_dir=tmp_path / "cache"
    )  # opened on the damage
    with pytest.raises(ImageCacheError, match=rf"{path.name} is damaged: image 5"):
        list(make_loader(fresh, batch_size=1, path="isolated"))


def test_make_loaders_isolated_path_measures_the_loop_and_takes_this_process_for_a_waiting_step():
    import time

    loader = make_loader(Records(64), batch_size=4, shuffle=True)  # auto: isolated, measured
    assert isinstance(loader, IsolatedLoader) and loader.adaptive

    def epoch(step):
        got = []
        for b in loader:
            got += b["ids"].tolist()
            step()
        return got

    def busy():  # Python on a CPU between batches (an eager step)
        end = time.perf_counter() + 0.004
        while time.perf_counter() < end:
            pass

    assert Counter(epoch(busy)) == Counter(range(64)) and not loader.in_process
    assert Counter(epoch(lambda: time.sleep(0.005))) == Counter(range(64)) and not loader.in_process
    assert (
        Counter(epoch(busy)) == Counter(range(64)) and loader.in_process
    )  # measured: the loop waited
    assert "path_measured" in loader.recipe.reasons and loader.child_pid is None
    assert "this process" in loader.recipe.reasons["path_measured"]
    assert (
        Counter(epoch(busy)) == Counter(range(64)) and not loader.in_process
    )  # busy again: the child
    assert loader.child_pid is not None
    given = make_loader(Records(64), batch_size=4, path="isolated")
    assert not given.adaptive  # a path the user chose stays chosen


class Priorities(Records):
    """Each batch says the scheduling priority (nice value) of the thread that read it."""

    def read_batch(self, indices, rng):
        return {
            "ids": torch.tensor(indices),
            "nice": torch.tensor(os.getpriority(os.PRIO_PROCESS, 0)),
        }


@pytest.mark.parametrize("niceness", [5, 0])
def test_the_child_reads_below_the_loops_priority_the_loop_keeps_its_own(niceness):
    loop = os.getpriority(os.PRIO_PROCESS, 0)
    loader = IsolatedLoader(Priorities(16), batch_size=4, niceness=niceness)
    try:
        for _ in range(
            2
        ):  # the child is kept over epochs: its priority lowered once, not per epoch
            nice = {int(b["nice"]) for b in loader}
            assert nice == {min(19, loop + niceness)}
    finally:
        loader.close()
    assert os.getpriority(os.PRIO_PROCESS, 0) == loop


@pytest.mark.parametrize("niceness", [-1, 20, 2.5, True])
def test_a_niceness_the_scheduler_cannot_take_is_refused_by_name(niceness):
    with pytest.raises(ValueError, match="niceness"):
        IsolatedLoader(Records(4), batch_size=2, niceness=niceness)


def test_make_loader_passes_niceness_to_the_child_and_says_when_no_child_uses_it():
    loop = os.getpriority(os.PRIO_PROCESS, 0)
    loader = make_loader(Priorities(64), batch_size=4, niceness=2)
    try:
        assert (
            isinstance(loader, IsolatedLoader) and loader.recipe.reasons["niceness"] == "override"
        )
        assert {int(b["nice"]) for b in loader} == {min(19, loop + 2)}
    finally:
        loader.close()
    short = make_loader(
        Priorities(8), batch_size=4, niceness=2
    )  # 2 batches an epoch: threads of this process
    assert not isinstance(short, IsolatedLoader)
    assert short.recipe.reasons["niceness"].startswith("2: unused, no child process")
    assert {int(b["nice"]) for b in short} == {loop}


@pytest.mark.parametrize("path", ["threads", "workers"])
def test_make_loader_refuses_niceness_on_a_path_the_user_chose_without_a_child(path):
    with pytest.raises(TypeError, match="niceness.*path='isolated'"):
        make_loader(Records(64), batch_size=4, path=path, niceness=3)
    with pytest.raises(ValueError, match="niceness"):
        make_loader(
            Records(8), batch_size=4, niceness=-3
        )  # refused before the path is known to need none


class DiesTwice:
    """The child dies at its 3rd read, and the next child soon after: RobustLoader's ladder goes
    from a new child to this process's threads."""

    def __init__(self):
        import multiprocessing

        self.parent = os.getpid()
        self.reads, self.kills = multiprocessing.Value("q", 0), multiprocessing.Value("q", 0)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i

    def thread_batches(self):
        return True

    def read_batch(self, indices, rng):
        if os.getpid() != self.parent:
            with self.reads.get_lock():
                self.reads.value += 1
                n = self.reads.value
            if n in (3, 8) and self.kills.value < 2:
                self.kills.value += 1
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor(indices)


@pytest.mark.parametrize("path", ["isolated", "auto"])
def test_robust_loader_given_a_niceness_steps_down_to_threads_each_sample_once(path):
    robust = RobustLoader(DiesTwice(), batch_size=4, path=path, niceness=3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            received = [i for b in robust for i in b.tolist()]
    finally:
        robust.close()
    assert Counter(received) == Counter(range(64))
    assert robust.restarts == [("death", {"path": "isolated"}), ("death", {"path": "threads"})]
    assert not isinstance(robust.loader, IsolatedLoader)


def test_make_loader_refuses_a_niceness_of_none():
    with pytest.raises(ValueError, match="niceness"):
        make_loader(Records(64), batch_size=4, niceness=None)
