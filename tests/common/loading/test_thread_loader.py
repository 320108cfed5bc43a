"""ThreadLoader and make_loader's path choice (issue 21): batches read by threads of this process,
yielded in order, with StatefulLoader's exact resume in any epoch and at the boundaries; the
exactly-once state machine (test_exactly_once.py) also draws the thread path."""

import json
import os
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

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
        ThreadLoader(
            type("Plain", (Dataset,), {"__len__": lambda s: 3, "__getitem__": lambda s, i: i})(),
            batch_size=2,
        )


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
    a = make_loader(
        ds, batch_size=4, shuffle=True, path="threads", generator=torch.Generator().manual_seed(1)
    )
    b = ThreadLoader(
        Slow(40),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
        threads=1,
        seed=a.seed,
    )
    assert [x[1].tolist() for x in a] == [x[1].tolist() for x in b]


@pytest.mark.parametrize("epoch", [0, 1, 2])
@pytest.mark.parametrize(
    "cut", [0, 1, 5, 12, 13]
)  # 13 batches: 0, inside, the last, after the last
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
    assert Counter(map(tuple, prefix + rest)) == Counter(
        map(tuple, expected[epoch])
    )  # counted: none lost or repeated
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
    reference = make_loader(
        Slow(50), batch_size=5, shuffle=True, num_workers=0, collate_fn=_as_batch
    )
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
    monitor = LoaderMonitor(
        make_loader(Slow(20), batch_size=4, path="threads"), warn_wait_fraction=1.0
    )
    for _ in monitor:
        pass
    assert monitor.summary()["samples"] == 20


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"\['num_workers', 'timeout'\]"):
        ThreadLoader(Slow(), batch_size=2, num_workers=2, timeout=5)
    with pytest.raises(ValueError, match="must be positive"):
        ThreadLoader(Slow(), batch_size=2, threads=0)
    assert np.all(
        np.diff([b[0][0].item() for b in ThreadLoader(Slow(8), batch_size=2, threads=3)]) == 2
    )


def test_a_collate_function_gets_the_items_in_a_thread():
    collated = []

    def collate(items):
        collated.append(threading.current_thread().name)
        return sorted(items)

    loader = make_loader(Slow(10), batch_size=4, collate_fn=collate)
    assert isinstance(loader, ThreadLoader) and [b for b in loader] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert all(name.startswith("ThreadLoader") for name in collated)


def test_pinned_batches_are_filled_in_place_when_read_batch_can(monkeypatch):
    """With CUDA and pin_memory, a read_batch that takes `pin_memory=` gets it (and fills its
    batch in pinned memory itself); other batches are copied into pinned memory afterwards."""
    import recipes.common.loading.thread_loader as module

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


class Flaky(Slow):
    """Index `bad` raises once per process (a transient read error the loop catches and skips)."""

    def __init__(self, n=40, bad=9):
        super().__init__(n)
        self.bad, self.failed = bad, False

    def _check(self, indices):
        if self.bad in indices and not self.failed:
            self.failed = True
            raise OSError(f"index {self.bad}: connection reset")

    def read_batch(self, indices, rng):
        self._check(indices)
        return super().read_batch(indices, rng)

    def __getitem__(self, i):
        self._check([i])
        return int(i)


PATHS = {
    "threads": dict(path="threads"),
    "isolated": dict(path="isolated"),
    "workers": dict(num_workers=2, collate_fn=_as_batch),
    "inline": dict(num_workers=0, collate_fn=_as_batch),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_state_saved_in_except_after_an_error_in_the_loop_body_resumes_there(path):
    """The loop body raises in epoch 1 (Ctrl-C, a failed step); the state saved in the except
    block resumes at the next batch: the rest of epoch 1, then epoch 2, as uninterrupted."""

    def build(seed):
        torch.manual_seed(seed)
        return make_loader(Slow(36), batch_size=4, shuffle=True, **PATHS[path])

    whole = build(0)
    expected = [_ids(whole) for _ in range(3)]
    first = build(0)
    list(first)
    got = []
    try:
        for batch in first:
            got.append(batch[0].tolist())
            if len(got) == 4:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["batches_yielded"] == 4
    second = build(99)
    second.load_state_dict(state)
    rest = _ids(second)
    assert (
        Counter(map(tuple, got + rest)) == Counter(map(tuple, expected[1]))
        and got + rest == expected[1]
    )
    assert _ids(second) == expected[2]
    third = build(0)
    list(third)
    for i, _ in enumerate(third):  # a plain break (a step limit) pauses the epoch too (issue #28)
        if i == 3:
            break
    paused = json.loads(json.dumps(third.state_dict()))
    assert (paused["epoch"], paused["batches_yielded"], paused.get("finished_epoch")) == (
        1,
        4,
        None,
    )
    fourth = build(99)
    fourth.load_state_dict(paused)
    assert got + _ids(fourth) == expected[1]  # the same four batches, then the rest


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_batch_whose_read_failed_is_behind_the_loop(path):
    """The loop catches a dataset error for batch 2 and goes on; a state saved two batches later
    resumes after them, not at a batch already received."""
    loader = make_loader(Flaky(40, bad=9), batch_size=4, **PATHS[path])
    reference = [b[0].tolist() for b in make_loader(Slow(40), batch_size=4, **PATHS[path])]
    iterator, got, errors = iter(loader), [], 0
    while len(got) < 4:
        try:
            got.append(next(iterator)[0].tolist())
        except OSError as error:
            assert "index 9" in str(error)
            errors += 1
    state = loader.state_dict()
    del iterator
    assert (
        errors == 1
        and got == [reference[i] for i in (0, 1, 3, 4)]
        and state["batches_yielded"] == 5
    )
    resumed = make_loader(Slow(40), batch_size=4, **PATHS[path])
    resumed.load_state_dict(state)
    assert _ids(resumed) == reference[5:]


def test_the_draw_seed_travels_in_the_state_and_make_loader_passes_thread_arguments():
    loader = make_loader(Slow(30), batch_size=4, shuffle=True, seed=5, threads=1, prefetch=1)
    assert (loader.seed, loader.threads, loader.prefetch) == (5, 1, 1)
    assert loader.recipe.settings["seed"] == 5 and loader.recipe.reasons["threads"].endswith(
        "override"
    )
    iterator = iter(loader)
    first = [next(iterator)[1].tolist() for _ in range(2)]
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [b[1].tolist() for b in iterator]
    other = make_loader(
        Slow(30), batch_size=4, shuffle=True, seed=77
    )  # another seed: the state's wins
    other.load_state_dict(state)
    assert [b[1].tolist() for b in other] == rest and len(first + rest) == 8
    with pytest.raises(
        TypeError, match=r"neither a ThreadLoader nor a DataLoader takes: \['bogus'\]"
    ):
        make_loader(Slow(30), batch_size=4, bogus=1)
    with pytest.raises(TypeError, match=r"\['seed', 'threads'\] configure the thread path"):
        make_loader(Slow(30), batch_size=4, num_workers=1, threads=2, seed=1)


def test_set_epoch_between_iter_and_the_first_batch_draws_that_epochs_batches():
    def build():
        ds = Slow(32)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=2)
        return make_loader(ds, batch_size=4, sampler=sampler, path="threads", seed=3), sampler

    reference, ref_sampler = build()
    ref_sampler.set_epoch(1)
    expected = [(b[0].tolist(), b[1].tolist()) for b in reference]
    loader, sampler = build()
    iterator = iter(loader)
    sampler.set_epoch(1)  # after iter(), before the first batch
    got = [(b[0].tolist(), b[1].tolist()) for b in (next(iterator), next(iterator), next(iterator))]
    state = loader.state_dict()
    del iterator
    resumed, _ = build()
    resumed.load_state_dict(state)
    assert got + [(b[0].tolist(), b[1].tolist()) for b in resumed] == expected


@pytest.mark.parametrize("path", ["threads", "isolated", "workers"])
def test_closing_mid_epoch_raises_and_the_state_resumes_there(path):
    settings = {
        "threads": dict(path="threads"),
        "isolated": dict(path="isolated"),
        "workers": dict(num_workers=2, collate_fn=_as_batch, persistent_workers=True),
    }[path]
    loader = make_loader(Slow(40), batch_size=4, **settings)
    reference = [b[0].tolist() for b in make_loader(Slow(40), batch_size=4, **settings)]
    iterator = iter(loader)
    got = [next(iterator)[0].tolist() for _ in range(3)]
    loader.close()
    from recipes.common.resume.loader_counting import LoaderClosedError

    with pytest.raises(LoaderClosedError, match="closed while its epoch was running"):
        next(iterator)
    state = loader.state_dict()
    assert state["batches_yielded"] == 3
    resumed = make_loader(Slow(40), batch_size=4, **settings)
    resumed.load_state_dict(state)
    assert got + _ids(resumed) == reference
    assert _ids(loader) == reference  # a new epoch after the close works


@pytest.mark.slow  # 3-6 s
def test_a_script_exits_quietly(tmp_path):
    """No "Exception ignored in ThreadLoader.__del__" at interpreter exit (a real interpreter:
    the zygote skips finalisation)."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "import torch\nfrom tests.common.loading.test_thread_loader import Slow\n"
        "from recipes.common import make_loader\n"
        "loader = make_loader(Slow(20), batch_size=4)\n"
        "for batch in loader:\n    pass\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).parents[3]),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr


@pytest.mark.slow  # 5 s
def test_the_training_threads_keep_torchs_thread_count(tmp_path):
    """Batches made in pool threads (a torch resize in each) leave the training loop's intra-op
    threads alone: the main thread, and a thread started after the loader, have as many as in
    a fresh interpreter. (A pool thread calling torch.set_num_threads(1) set the process-wide
    count that threads take at their first parallel op: the loop's matmuls ran on one core.)"""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent("""
        import threading, torch
        from recipes.common import make_loader

        class Resized(torch.utils.data.Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                return i
            def thread_batches(self):
                return True
            def read_batch(self, indices, rng):
                big = torch.zeros((1, 3, 512, 512), dtype=torch.uint8)
                big = big.contiguous(memory_format=torch.channels_last)
                out = torch.nn.functional.interpolate(
                    big, size=(224, 224), mode="bilinear", antialias=True
                )
                return out.expand(len(indices), -1, -1, -1), torch.tensor(indices)

        loader = make_loader(Resized(), batch_size=4)
        for images, _ in loader:  # no torch op in this thread before the loader's
            during = torch.get_num_threads()
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        print(during, torch.get_num_threads(), later[0])
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [fresh.stdout.strip()] * 3, (out.stdout, fresh.stdout)
