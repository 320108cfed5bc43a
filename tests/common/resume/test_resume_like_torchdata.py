"""Resume cases of torchdata's StatefulDataLoader suite (meta-pytorch/data v0.11.0,
test/stateful_dataloader/test_state_dict.py), written for `StatefulLoader` / `make_loader` (issue
#28).

Each test compares a resumed run with an uninterrupted run of the same settings (its own
expectation) and counts samples (`Counter`) where exactly-once is the claim. Every state of ours
goes through `json.loads(json.dumps(state))` before it is loaded. Where torchdata's semantics are
the same, the scenario also runs on `torchdata.stateful_dataloader.StatefulDataLoader` (the
`impl="torchdata"` parametrisations, skipped without torchdata) to show the expectation is
torchdata's too; its state holds tensors, so it is deep-copied instead.

The contract under test:
1. a state saved after `break` is a pause: it resumes at the first batch the loop did not get;
   iterating the same loader again starts the next epoch (DataLoader's behaviour);
2. `in_order=False` with workers is refused at construction;
3. the dataset's random draws (torch, NumPy, Python) are reproduced on resume, whatever the
   resumed process's seed or worker count, and never disturb the loop's own torch stream;
4. a dataset's own `state_dict()` / `load_state_dict()` is honoured (no replay of its `__iter__`),
   including Hugging Face `datasets.IterableDataset` resumed in a fresh process;
5. stateful samplers, `set_epoch` over several epochs, and load-then-save.
"""

from __future__ import annotations

import copy
import json
import random
import runpy
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler, get_worker_info

from recipes.common import StatefulLoader, make_loader

IMPLS = ["ours", pytest.param("torchdata", marks=pytest.mark.slow)]
# (num_workers, persistent_workers)
WORKERS = [(0, False), (2, False), (2, True)]
WORKER_IDS = ["w0", "w2", "w2-persistent"]


# ---- datasets and samplers ------------------------------------------------------------------
class Ids(Dataset):
    """Item i is i; on the thread path a batch is `[[i, draw]]`, the draw from the batch's rng."""

    def __init__(self, n: int = 40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)

    def thread_batches(self):  # ThreadBatched: make_loader(..., path="threads")
        return True

    def read_batch(self, indices, rng):
        return torch.tensor([[int(i), int(rng.integers(1 << 30))] for i in indices])


class Strided(IterableDataset):
    """range(n), worker w of W yielding w, w+W, ... (split by `get_worker_info()`); no state."""

    def __init__(self, n: int = 40):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, self.n, workers))


class RandomItems(Dataset):
    """Item i is (i, a torch draw, a NumPy draw, a Python draw), all from the global generators."""

    def __init__(self, n: int = 20):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (int(i), torch.rand(()).item(), float(np.random.rand()), random.random())


class QuietItems(RandomItems):
    def __getitem__(self, i):
        return (int(i), 0.0, 0.0, 0.0)


class KeepsPosition(IterableDataset):
    """range(n), sharded over workers by `get_worker_info()`, that keeps its position in its shard
    and saves it (`state_dict`/`load_state_dict`: torchdata's protocol); no `resume_after`.
    Every item it generates is appended to `log`, to count what a resume generates again."""

    def __init__(self, n: int, log: Path):
        self.n, self.log, self.next = n, str(log), 0

    def __iter__(self):
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard = range(wid, self.n, workers)
        while self.next < len(shard):
            item = shard[self.next]
            self.next += 1
            with open(self.log, "a") as f:
                f.write(f"{item}\n")
            yield item
        self.next = 0  # the epoch ended: the next one is whole

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = int(state["next"])


class SelfIterator(IterableDataset):
    """A dataset that is its own iterator (`__iter__` returns self), with its position as state."""

    def __init__(self, n: int = 40):
        self.n, self.i, self.generated = n, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            self.i = 0  # the next epoch is whole
            raise StopIteration
        self.i += 1
        self.generated += 1
        return self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = int(state["i"])


class PassSeededSampler(Sampler):
    """A sampler whose order follows from its state: a permutation seeded by (seed, passes);
    `passes` moves on when a pass is drawn to its end. No generator attribute, no `set_epoch`:
    the loader knows its order only through `state_dict()`."""

    def __init__(self, n: int, seed: int = 3):
        self.n, self.seed, self.passes = n, seed, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.passes)
        yield from torch.randperm(self.n, generator=g).tolist()
        self.passes += 1

    def state_dict(self):
        return {"seed": self.seed, "passes": self.passes}

    def load_state_dict(self, state):
        self.seed, self.passes = int(state["seed"]), int(state["passes"])


def as_list(batch):
    return batch


# ---- helpers --------------------------------------------------------------------------------
def torchdata_loader():
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def loader_class(impl):
    return StatefulLoader if impl == "ours" else torchdata_loader()


def saved(loader, impl="ours"):
    """The loader's state as a checkpoint holds it: plain JSON for ours (torchdata's holds
    tensors)."""
    state = loader.state_dict()
    return json.loads(json.dumps(state)) if impl == "ours" else copy.deepcopy(state)


def key(batch):
    """A batch as plain, comparable values."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, dict):
        return {k: key(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [key(b) for b in batch]
    return batch


def ids(batches):
    """The sample ids of `batches` (of keys): ints, or the first column of rows."""
    out = []
    for batch in batches:
        for item in batch["x"] if isinstance(batch, dict) else batch:
            out.append(item[0] if isinstance(item, list) else item)
    return out


def epoch(loader):
    return [key(b) for b in loader]


def take(loader, k):
    """The loop's first `k` batches of an epoch, left by `break`; k=0: `iter()` then dropped
    before any batch; k=None: the whole epoch (exhausted)."""
    if k is None:
        return epoch(loader)
    got = []
    if k == 0:
        iterator = iter(loader)
        del iterator
        return got
    for batch in loader:
        got.append(key(batch))
        if len(got) == k:
            break
    return got


def workers_kwargs(workers, persistent):
    return {"num_workers": workers, **({"persistent_workers": persistent} if workers else {})}


# ---- 1. a state saved after `break` is a pause ----------------------------------------------
def test_the_issue_example_break_after_11_resumes_at_11():
    loader = StatefulLoader(list(range(100)), batch_size=1)
    seen = []
    for batch in loader:
        seen.append(int(batch))
        if len(seen) == 11:
            break
    state = saved(loader)
    fresh = StatefulLoader(list(range(100)), batch_size=1)
    fresh.load_state_dict(state)
    rest = [int(b) for b in fresh]
    assert rest == list(range(11, 100)), f"resumed {len(rest)} samples starting at {rest[:1]}"
    assert Counter(seen + rest) == Counter(range(100))


def build_kind(kind, workers, persistent, impl="ours", seed=0):
    """A loader of `kind`; `seed` seeds torch's global generator first (a resumed process uses
    another: the state must carry what matters)."""
    torch.manual_seed(seed)
    kw = workers_kwargs(workers, persistent)
    if kind == "map":
        return loader_class(impl)(Ids(), batch_size=2, **kw)
    if kind == "shuffle":
        return loader_class(impl)(
            Ids(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4), **kw
        )
    if kind == "iterable":
        return loader_class(impl)(Strided(), batch_size=2, **kw)
    if kind == "make_loader":
        return make_loader(
            Ids(),
            batch_size=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(4),
            path="workers",
            tuned=False,
            **kw,
            **({"prefetch_factor": 2} if workers else {}),
        )
    assert kind == "threads"
    return make_loader(
        Ids(),
        batch_size=2,
        shuffle=True,
        generator=torch.Generator().manual_seed(4),
        path="threads",
        threads=2,
        tuned=False,
    )


PAUSE_CASES = [
    pytest.param(
        kind,
        workers,
        persistent,
        at_epoch,
        impl,
        id=f"{kind}-{wid}-epoch{at_epoch}-{impl}",
        marks=[pytest.mark.slow] if (impl == "torchdata" or (at_epoch == 2 and workers)) else [],
    )
    for kind in ["map", "shuffle", "iterable", "make_loader", "threads"]
    for (workers, persistent), wid in zip(WORKERS, WORKER_IDS, strict=True)
    for at_epoch in (0, 2)
    for impl in ("ours", "torchdata")
    if not (kind == "threads" and workers)
    and not (impl == "torchdata" and kind in ("make_loader", "threads"))
]


@pytest.mark.parametrize("kind, workers, persistent, at_epoch, impl", PAUSE_CASES)
def test_a_state_saved_after_break_resumes_where_the_loop_stopped(
    kind, workers, persistent, at_epoch, impl
):
    """Saved before any batch, mid-epoch after `break`, and after the epoch was exhausted (the
    next epoch starts whole), in epoch 0 and epoch 2: a fresh loader goes on from there, and the
    epoch after is the uninterrupted run's too."""
    reference = build_kind(kind, workers, persistent, impl)
    full = [epoch(reference) for _ in range(at_epoch + 3)]
    total = len(full[at_epoch])
    assert total == 20
    # torchdata without workers: its sampler and its base seed draw from the one `generator`, and
    # its state restores the sampler's only, so the epochs after the resumed one (and an epoch
    # resumed from its end) differ from the uninterrupted run's; the resumed epoch's rest agrees
    torchdata_shares_its_generator = impl == "torchdata" and kind == "shuffle" and not workers
    for k in (0, 7, None):
        first = build_kind(kind, workers, persistent, impl)
        for _ in range(at_epoch):
            epoch(first)
        prefix = take(first, k)
        state = saved(first, impl)
        del first
        second = build_kind(kind, workers, persistent, impl, seed=999)
        second.load_state_dict(state)
        rest, after = epoch(second), epoch(second)
        if k is None:  # exhausted: the state is the next epoch's start
            assert prefix == full[at_epoch]
            if torchdata_shares_its_generator:
                continue
            assert (rest, after) == (full[at_epoch + 1], full[at_epoch + 2]), (
                f"saved at the end of epoch {at_epoch}"
            )
            continue
        assert prefix + rest == full[at_epoch], (
            f"saved after {k} batches of epoch {at_epoch}: resumed "
            f"{len(rest)} batches, {total - k} expected"
        )
        assert Counter(ids(prefix + rest)) == Counter(range(40))
        if torchdata_shares_its_generator:
            continue
        assert after == full[at_epoch + 1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_iterating_the_same_loader_after_break_starts_the_next_epoch(workers, persistent, impl):
    """DataLoader's behaviour: after `break`, a new `iter()` is a whole new epoch, not the rest
    of the broken one. Its order need not be the uninterrupted run's second epoch (a
    `RandomSampler` left early skips the draw its exhausted iterator makes at its end), so the
    expectation is the same history without a save: a state saved in that next epoch resumes it."""
    reference = build_kind("shuffle", workers, persistent, impl)
    first_epoch = epoch(reference)
    reference = build_kind("shuffle", workers, persistent, impl)
    assert take(reference, 5) == first_epoch[:5]
    expected = [epoch(reference), epoch(reference)]
    assert len(expected[0]) == 20 and Counter(ids(expected[0])) == Counter(range(40))
    assert expected[0][:15] != first_epoch[5:]

    loader = build_kind("shuffle", workers, persistent, impl)
    take(loader, 5)
    prefix = take(loader, 3)  # the next epoch's first 3 batches
    state = saved(loader, impl)
    del loader
    fresh = build_kind("shuffle", workers, persistent, impl, seed=999)
    fresh.load_state_dict(state)
    resumed = [prefix + epoch(fresh), epoch(fresh)]
    if (
        impl == "torchdata" and not workers
    ):  # its shared generator (see the test above): the rest agrees
        resumed, expected = resumed[:1], expected[:1]
    assert resumed == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_states_loaded_back_into_the_same_loader(workers, persistent, impl):
    """torchdata's test_map_iterrupted_shuffle: a state taken at iter() and one taken after 4
    batches, each loaded back into the loader that saved them."""
    loader = build_kind("shuffle", workers, persistent, impl)
    iterator = iter(loader)
    at_start = saved(loader, impl)
    got = [key(next(iterator)) for _ in range(4)]
    after_four = saved(loader, impl)
    del iterator
    loader.load_state_dict(after_four)
    got += epoch(loader)
    loader.load_state_dict(at_start)
    assert epoch(loader) == got
    assert Counter(ids(got)) == Counter(range(40))


# ---- 2. in_order=False with workers is refused ------------------------------------------------
def test_in_order_false_with_workers_is_refused_at_construction():
    with pytest.raises(ValueError, match="in_order"):
        StatefulLoader(Ids(), batch_size=2, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match="in_order"):
        make_loader(Ids(), batch_size=2, num_workers=2, in_order=False, path="workers", tuned=False)


def test_in_order_false_without_workers_is_accepted_and_resumes():
    def build():
        return StatefulLoader(Ids(), batch_size=2, num_workers=0, in_order=False)

    full = epoch(build())
    first = build()
    prefix = take(first, 6)
    second = build()
    second.load_state_dict(saved(first))
    assert prefix + epoch(second) == full


# ---- 3. the workers' randomness is reproduced -----------------------------------------------
def build_random(workers, persistent, dataset=None):
    return StatefulLoader(
        dataset or RandomItems(),
        batch_size=2,
        shuffle=True,
        collate_fn=as_list,
        generator=torch.Generator().manual_seed(4),
        **workers_kwargs(workers, persistent),
    )


SAVE_POINTS = {"mid-epoch0": (0, 3), "end-epoch0": (0, None), "mid-epoch1": (1, 3)}


@pytest.mark.parametrize("point", list(SAVE_POINTS))
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_the_datasets_random_draws_are_reproduced_on_resume(workers, persistent, point):
    at_epoch, k = SAVE_POINTS[point]
    torch.manual_seed(0)
    reference = build_random(workers, persistent)
    full = [epoch(reference) for _ in range(3)]
    torch.manual_seed(0)
    first = build_random(workers, persistent)
    for _ in range(at_epoch):
        epoch(first)
    prefix = take(first, k)
    state = saved(first)
    del first
    torch.manual_seed(999)  # the resumed process's own seed does not matter
    second = build_random(workers, persistent)
    second.load_state_dict(state)
    rest, after = epoch(second), epoch(second)
    if k is None:
        assert (rest, after) == (full[at_epoch + 1], full[at_epoch + 2])
    else:
        assert prefix + rest == full[at_epoch], (
            "(index, torch, numpy, python) of the resumed epoch differ"
        )
        assert after == full[at_epoch + 1]


def test_the_random_draws_follow_the_batch_not_the_worker():
    """Saved with 2 workers, resumed with none: the same values, which are also those of an
    uninterrupted run without workers."""
    torch.manual_seed(0)
    with_workers = [epoch(build_random(2, False))]
    torch.manual_seed(5)
    without = [epoch(build_random(0, False))]
    torch.manual_seed(0)
    first = build_random(2, False)
    prefix = take(first, 3)
    state = saved(first)
    del first
    torch.manual_seed(999)
    second = build_random(0, False)
    second.load_state_dict(state)
    assert prefix + epoch(second) == with_workers[0]
    assert without == with_workers


def test_the_datasets_draws_leave_the_loops_torch_stream_alone():
    def loop_draws(dataset):
        loader = build_random(0, False, dataset)
        torch.manual_seed(0)
        draws = []
        for _ in range(2):
            for _batch in loader:
                draws.append(torch.rand(()).item())
        return draws

    assert loop_draws(RandomItems()) == loop_draws(QuietItems())


# ---- 4. a dataset's own state_dict is honoured ------------------------------------------------
def generated(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_an_iterable_datasets_own_state_resumes_without_replaying_it(
    tmp_path, workers, persistent, impl
):
    n, bs, k = 64, 4, 5

    def build(log):
        return loader_class(impl)(
            KeepsPosition(n, tmp_path / log), batch_size=bs, **workers_kwargs(workers, persistent)
        )

    full = epoch(build("full.log"))
    first = build("first.log")
    prefix = take(first, k)
    state = saved(first, impl)
    del first
    second = build("resumed.log")
    second.load_state_dict(state)
    rest = epoch(second)
    assert prefix + rest == full, "the resumed epoch differs from the uninterrupted one"
    assert Counter(ids(prefix + rest)) == Counter(range(n))
    again = generated(tmp_path / "resumed.log")
    replayed = sorted(set(again) & set(ids(prefix)))
    assert not replayed, (
        f"the resumed loader iterated the dataset from its start again (regenerated {replayed})"
    )
    in_flight = workers * 2 * bs  # what the first run's workers may have made beyond the loop
    assert len(again) <= n - k * bs + in_flight
    assert (
        len(generated(tmp_path / "first.log")) + len(again)
        <= len(generated(tmp_path / "full.log")) + in_flight
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_a_dataset_that_is_its_own_iterator_resumes_from_its_state(impl):
    n, bs, k = 40, 4, 3

    def build():
        return loader_class(impl)(SelfIterator(n), batch_size=bs)

    full = epoch(build())
    first = build()
    prefix = take(first, k)
    state = saved(first, impl)
    second = build()
    second.load_state_dict(state)
    rest = epoch(second)
    assert prefix + rest == full
    assert Counter(ids(prefix + rest)) == Counter(range(n))
    assert second.dataset.generated == n - k * bs, "the dataset was iterated from its start again"
    assert epoch(second) == full  # and the next epoch is whole


HF_SCRIPT = """
import json, sys
import datasets
from recipes.common import make_loader


class Logged:
    def __init__(self, log):
        self.log = log

    def __call__(self, example):
        with open(self.log, "a") as f:
            f.write(f"{example['x']}\\n")
        return example


def build(workers, log, impl="ours"):
    ds = datasets.Dataset.from_dict({"x": list(range(64))})
    ds = ds.to_iterable_dataset(num_shards=4).map(Logged(log))
    if impl == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(ds, batch_size=4, num_workers=workers)
    return make_loader(ds, batch_size=4, num_workers=workers)


if __name__ == "__main__":
    workers = int(sys.argv[1])
    state_file, out_file, log, impl = sys.argv[2:6]
    loader = build(workers, log, impl)
    with open(state_file) as f:
        loader.load_state_dict(json.load(f))
    rest = [batch["x"].tolist() for batch in loader]
    with open(out_file, "w") as f:
        json.dump(rest, f)
"""


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workers", [0, 2])  # a fresh process each: 4-17 s, slow tier
@pytest.mark.slow
def test_a_hugging_face_iterable_dataset_resumes_in_a_fresh_process(tmp_path, workers, impl):
    """`datasets.IterableDataset` resumes by its own state_dict (how Hugging Face's does with
    torchdata): every sample once across the interruption, and the resumed process does not make
    again the examples the first one's loop received (its `.map` logs what it makes)."""
    pytest.importorskip("datasets")
    if impl == "torchdata":
        torchdata_loader()
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(HF_SCRIPT))
    build = runpy.run_path(str(script))["build"]
    full = [b["x"].tolist() for b in build(workers, tmp_path / "full.log", impl)]
    first = build(workers, tmp_path / "first.log", impl)
    prefix = []
    for batch in first:
        prefix.append(batch["x"].tolist())
        if len(prefix) == 5:
            break
    (tmp_path / "state.json").write_text(
        json.dumps(first.state_dict())
    )  # torchdata's is JSON here too
    del first
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(workers),
            str(tmp_path / "state.json"),
            str(tmp_path / "rest.json"),
            str(tmp_path / "resumed.log"),
            impl,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rest = json.loads((tmp_path / "rest.json").read_text())
    seen = Counter(x for batch in prefix + rest for x in batch)
    assert seen == Counter(range(64)), (
        f"repeated {sorted(x for x, c in seen.items() if c > 1)}, "
        f"lost {sorted(set(range(64)) - set(seen))}"
    )
    assert prefix + rest == full
    again = sorted(
        set(generated(tmp_path / "resumed.log")) & {x for batch in prefix for x in batch}
    )
    assert not again, (
        f"the resumed process read the dataset from its start again (made {again} again)"
    )


# ---- 5. samplers, set_epoch, load-then-save -------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_with_its_own_state_resumes(workers):
    """Our contract (loader_contract.StatefulSampler): the sampler's state at the draw, restored
    at the resumed draw, the loop's batches skipped by the loader. Not torchdata's: it expects a
    stateful sampler to save its own position in the pass and skips nothing, so this sampler
    (whose state is its order, not its position) repeats the first batches there."""
    impl = "ours"

    def build():
        return loader_class(impl)(
            Ids(20),
            batch_size=2,
            sampler=PassSeededSampler(20),
            **workers_kwargs(workers, False),
        )

    reference = build()
    full = [epoch(reference) for _ in range(3)]
    assert full[0] != full[1]
    first = build()
    epoch(first)
    prefix = take(first, 3)
    state = saved(first, impl)
    del first
    second = build()
    second.load_state_dict(state)
    assert prefix + epoch(second) == full[1]
    assert epoch(second) == full[2]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [None, 3], ids=["after-2-epochs", "mid-epoch1"])
def test_several_epochs_with_set_epoch(workers, k, impl):
    """torchdata's TestMultiEpochSDL with an epoch-seeded sampler: the loop calls set_epoch(e)
    before each epoch, also in the resumed run."""

    def build():
        sampler = DistributedSampler(Ids(20), num_replicas=1, rank=0, shuffle=True, seed=5)
        return loader_class(impl)(
            Ids(20), batch_size=2, sampler=sampler, **workers_kwargs(workers, False)
        )

    def run(loader, epochs):
        out = []
        for e in epochs:
            loader.sampler.set_epoch(e)
            out.append(epoch(loader))
        return out

    full = run(build(), range(4))
    first = build()
    got = run(first, range(2 if k is None else 1))
    if k is not None:
        first.sampler.set_epoch(1)
        got.append(take(first, k))
    state = saved(first, impl)
    del first
    second = build()
    second.load_state_dict(state)
    if k is None:
        got += run(second, (2, 3))
    else:
        rest = run(second, (1,))[0]
        got[-1] += rest
        got += run(second, (2, 3))
    assert got == full
    assert Counter(ids(b for e in got for b in e)) == Counter({i: 4 for i in range(20)})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("workers, persistent", WORKERS, ids=WORKER_IDS)
def test_a_loaded_state_saved_again_before_iterating_is_equivalent(workers, persistent, impl):
    """torchdata's test_load_then_state: loaded into a loader mid-epoch of its own, the state
    it then gives resumes as the loaded one does."""
    full = epoch(build_kind("shuffle", workers, persistent, impl))
    first = build_kind("shuffle", workers, persistent, impl)
    prefix = take(first, 4)
    state = saved(first, impl)
    del first
    busy = build_kind("shuffle", workers, persistent, impl, seed=7)
    take(busy, 3)
    busy.load_state_dict(state)
    again = saved(busy, impl)
    from_again = build_kind("shuffle", workers, persistent, impl, seed=8)
    from_again.load_state_dict(again)
    assert prefix + epoch(from_again) == full
    assert prefix + epoch(busy) == full


@pytest.fixture(autouse=True)
def _quiet_worker_count_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        yield
