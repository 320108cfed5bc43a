"""ElasticDistributedSampler (issue #38): `DistributedSampler`'s order, and a state that resumes
on any number of ranks: every sample of an interrupted epoch once over the ranks before and
after (counted: the padding of the last deal to equal steps is the only repeat, and with
`drop_last` the tail it cuts the only loss), from rank 0's state or each rank's own, on the
worker and thread paths; under `make_loader`'s loader an epoch moves on without `set_epoch`."""

from __future__ import annotations

import collections
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from recipes.common import ElasticDistributedSampler, make_loader


class Numbers:
    """Sample i is i (a map-style dataset of `n`)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class ThreadNumbers(Numbers):
    """The same samples, read by threads (`make_loader`'s thread path)."""

    def thread_batches(self) -> bool:
        return True


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 90),
    world=st.integers(1, 6),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_the_order_is_distributed_samplers(n, world, seed, epoch, shuffle, drop_last):
    for rank in range(world):
        ours = ElasticDistributedSampler(
            Numbers(n),
            num_replicas=world,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        theirs = DistributedSampler(
            Numbers(n),
            num_replicas=world,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _loaders(dataset, world: int, batch: int, *, drop_last: bool, states=None, workers: int = 0):
    loaders = []
    for rank in range(world):
        sampler = ElasticDistributedSampler(
            dataset, num_replicas=world, rank=rank, seed=7, drop_last=drop_last
        )
        extra = (
            {"path": "threads", "threads": 2}
            if isinstance(dataset, ThreadNumbers)
            else {"num_workers": workers}
        )
        loader = make_loader(dataset, batch_size=batch, sampler=sampler, collate_fn=list, **extra)
        if states is not None:
            loader.load_state_dict(json.loads(json.dumps(states[rank % len(states)])))
        loaders.append(loader)
    return loaders


def _run(n, batch, shapes, *, drop_last=False, own_states=False, dataset=None, workers=0):
    """Epoch 0 over `shapes` (ranks, steps; None: to the end), each later shape loading rank 0's
    state (or, `own_states`, each new rank the state of old rank `r % old ranks`). Returns the
    count of every sample and the samples consumed before the last shape."""
    dataset = dataset or Numbers(n)
    counts, states, consumed = collections.Counter(), None, 0
    for world, steps in shapes:
        loaders = _loaders(
            dataset, world, batch, drop_last=drop_last, states=states, workers=workers
        )
        iterators = [iter(loader) for loader in loaders]
        if steps is None:
            lengths = []
            for iterator in iterators:
                got = list(iterator)
                lengths.append(len(got))
                counts.update(i for b in got for i in b)
            assert len(set(lengths)) == 1, lengths  # equal steps on every rank
            return counts, consumed, world
        for _ in range(steps):
            for iterator in iterators:
                counts.update(next(iterator))
        consumed += steps * batch * world
        states = (
            [loader.state_dict() for loader in loaders] if own_states else [loaders[0].state_dict()]
        )
        del iterators
    raise AssertionError("the last shape reads to the end")


def _shapes(draw_n: int, batch: int):
    """Shapes whose interrupted steps stay inside the epoch: (ranks, steps) ..., (ranks, None)."""

    @st.composite
    def build(draw):
        shapes, left = [], draw_n
        for _ in range(draw(st.integers(0, 3))):
            world = draw(st.integers(1, 5))
            full = left // (batch * world)  # steps every rank can take with whole batches
            if full < 1:
                break
            steps = draw(st.integers(0, full - 1 if full > 1 else 0))
            shapes.append((world, steps))
            left -= steps * batch * world
        return [*shapes, (draw(st.integers(1, 5)), None)]

    return build()


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 80),
    batch=st.integers(1, 5),
    drop_last=st.booleans(),
    own=st.booleans(),
)
def test_any_sequence_of_shapes_reads_every_sample_once(data, n, batch, drop_last, own):
    shapes = data.draw(_shapes(n, batch))
    counts, consumed, last = _run(n, batch, shapes, drop_last=drop_last, own_states=own)
    rest = n - consumed
    if drop_last:  # the last deal cuts what does not divide over its ranks, nothing repeats
        assert max(counts.values(), default=1) == 1 and len(counts) == n - rest % last
    else:  # the last deal pads to equal steps with the order's first samples: the only repeats
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == (-rest) % last


@pytest.mark.parametrize("kind", ["workers", "threads"])
def test_four_ranks_stopped_after_six_steps_finish_on_three(kind):
    """The issue's case on both paths: 4 ranks x batch 8 stopped after 6 steps, 3 new ranks
    loading rank 0's state: 720 samples once over both runs, 22 equal steps on the new ranks."""
    dataset = ThreadNumbers(720) if kind == "threads" else Numbers(720)
    counts, consumed, _ = _run(
        720, 8, [(4, 6), (3, None)], dataset=dataset, workers=2 if kind == "workers" else 0
    )
    assert consumed == 192 and sorted(counts) == list(range(720)) and sum(counts.values()) == 720


def test_a_loop_without_set_epoch_gets_a_new_order_each_epoch_and_its_state_the_next_epoch():
    dataset = Numbers(40)
    loader = make_loader(
        dataset,
        batch_size=4,
        collate_fn=list,
        num_workers=0,
        sampler=ElasticDistributedSampler(dataset, num_replicas=2, rank=1, seed=3),
    )
    first = [i for b in loader for i in b]
    state = loader.state_dict()
    second = [i for b in loader for i in b]
    assert first != second and len(first) == len(second) == 20  # this rank's half of another order
    assert (state["epoch"], state["finished_epoch"]) == (1, 0)  # resumes at the next epoch's start
    again = make_loader(
        dataset,
        batch_size=4,
        collate_fn=list,
        num_workers=0,
        sampler=ElasticDistributedSampler(dataset, num_replicas=2, rank=1, seed=3),
    )
    again.load_state_dict(state)
    assert [i for b in again for i in b] == second
    plain = ElasticDistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    plain.set_epoch(1)
    assert list(plain) == second  # the epochs are set_epoch's: a loop that calls it sees the same


def test_a_state_under_other_settings_is_refused_naming_them():
    dataset = Numbers(30)
    loader = make_loader(
        dataset, batch_size=4, num_workers=0, sampler=ElasticDistributedSampler(dataset, seed=1)
    )
    next(iter(loader))
    state = loader.state_dict()
    other = make_loader(
        dataset, batch_size=4, num_workers=0, sampler=ElasticDistributedSampler(dataset, seed=2)
    )
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="`rank` must be in"):
        ElasticDistributedSampler(dataset, num_replicas=2, rank=2)


def test_make_loader_splits_the_ranks_of_a_process_group_by_itself(zygote, tmp_path):
    """Two processes of a real gloo group: `make_loader(shuffle=True)` gives each its half (an
    ElasticDistributedSampler, named in the recipe); a sampler of the user's wins;
    `distributed=False` reads everything on every rank."""
    code = r"""
import json, os, sys, torch, torch.distributed as dist
from torch.utils.data import SequentialSampler
from recipes.common import make_loader
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
class Numbers:
    def __len__(self): return 50
    def __getitem__(self, i): return i
loader = make_loader(Numbers(), batch_size=4, shuffle=True, num_workers=0, collate_fn=list)
own = make_loader(
    Numbers(), batch_size=4, sampler=SequentialSampler(range(50)), num_workers=0, collate_fn=list
)
whole = make_loader(
    Numbers(), batch_size=4, shuffle=True, num_workers=0, collate_fn=list, distributed=False
)
out = {"mine": [i for b in loader for i in b], "why": loader.recipe.reasons["sampler"],
       "own": [i for b in own for i in b], "own_why": own.recipe.reasons["sampler"],
       "whole": sorted(i for b in whole for i in b), "sampler": type(loader.sampler).__name__}
open(sys.argv[2], "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    children = [zygote.python(code, r, tmp_path / f"{r}.json", env=env) for r in range(2)]
    for child in children:
        assert child.wait(timeout=60) == 0, child.stderr
    out = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert all(o["sampler"] == "ElasticDistributedSampler" and "2 ranks" in o["why"] for o in out)
    both = collections.Counter(out[0]["mine"] + out[1]["mine"])
    assert (
        sorted(both) == list(range(50)) and sum(both.values()) == 50 and len(out[0]["mine"]) == 25
    )
    assert all(
        o["own"] == list(range(50)) and o["own_why"].startswith("given (SequentialSampler")
        for o in out
    )
    assert all(o["whole"] == list(range(50)) for o in out)


def test_the_state_is_the_same_size_whatever_the_position():
    dataset = Numbers(10_000)
    loader = make_loader(
        dataset,
        batch_size=10,
        num_workers=0,
        collate_fn=list,
        sampler=ElasticDistributedSampler(dataset, num_replicas=4, rank=0),
    )
    iterator = iter(loader)
    sizes = []
    for steps in (1, 200):
        while len(sizes) < steps:
            next(iterator)
            sizes.append(None)
        sizes[-1] = len(json.dumps(loader.state_dict()))
    assert (
        sizes[-1] - sizes[0] == len("200") - len("1") + len("8000") - len("40") and sizes[0] < 4000
    )


@pytest.mark.parametrize("path", ["threads", "workers"])
def test_a_loaded_state_survives_set_epoch_to_its_epoch_after_iter(path):
    """Lightning's order: the state is loaded, `iter()`, then `sampler.set_epoch(epoch)`. The
    epoch the sampler is at keeps its loaded position (another epoch would start afresh)."""
    dataset = ThreadNumbers(64)

    def build():
        sampler = ElasticDistributedSampler(dataset, num_replicas=2, rank=0, seed=0)
        extra = (
            {"path": "threads", "threads": 2}
            if path == "threads"
            else {"path": "workers", "num_workers": 2}
        )
        return make_loader(dataset, batch_size=4, sampler=sampler, collate_fn=list, **extra)

    whole = build()
    whole.sampler.set_epoch(1)
    uninterrupted = list(whole)
    first = build()
    first.sampler.set_epoch(1)
    iterator = iter(first)
    head = [next(iterator) for _ in range(5)]
    state = first.state_dict()
    del iterator
    resumed = build()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    resumed.sampler.set_epoch(1)
    assert head + list(iterator) == uninterrupted
