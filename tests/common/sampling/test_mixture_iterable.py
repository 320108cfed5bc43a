"""MixtureIterable (issue 48): weights as a schedule, shares in tokens, and an elastic resume.
An epoch over shard sets stopped on 2 ranks x 2 workers and finished on 3 x 1 or on 1 x 2
reads every sample once (counted; with `even` sources the only repeats are each deal's padding,
at most ranks - 1 per source); token shares held in what the loop receives; the construction
errors; fixed weights in samples draw as before (frozen stream); pickling."""

from __future__ import annotations

import collections
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes.common import MixtureIterable, ShardedIterableDataset, StatefulLoader, make_loader
from recipes.common.sampling.iterable_mixing.mixture_draws import PacedDraws, Progress
from recipes.common.sampling.pacing.mixture_schedule import Schedule
from recipes.testing import make_int_shards

SIZES = {"a": [30, 25, 41, 20], "b": [35, 17, 28]}  # source b's ids start at 1000


def _read(path, start, stop):
    return [int(x) for x in Path(path).read_text().split()][start:stop]


def _read_b(path, start, stop):
    return [1000 + x for x in _read(path, start, stop)]


def _tokens(item) -> int:
    """Samples of source a are 10 tokens long, of source b 40."""
    if item < 1000:
        return 10
    return 40


@pytest.fixture
def shards(tmp_path):
    return {name: make_int_shards(tmp_path / name, sizes) for name, sizes in SIZES.items()}


def _sources(shards, rank=0, world=1, *, even=False):
    return {
        name: ShardedIterableDataset(
            shards[name],
            {"a": _read, "b": _read_b}[name],
            shard_lengths=SIZES[name],
            rank=rank,
            world_size=world,
            split="samples",
            seed=3,
            even=even,
        )
        for name in SIZES
    }


def _all_ids():
    a = sum(SIZES["a"])
    b = sum(SIZES["b"])
    return list(range(a)) + list(range(1000, 1000 + b))


def _epoch_over_shapes(build, shapes, batch):
    """Epoch 0 over `shapes` (ranks, workers, steps; None: to the end), each later shape loading
    rank 0's state as JSON: the count of every sample the loops received."""
    counts = collections.Counter()
    state = None
    for world, workers, steps in shapes:
        loaders = []
        for rank in range(world):
            loader = StatefulLoader(build(rank, world), batch_size=batch, num_workers=workers)
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            loaders.append(loader)
        iterators = [iter(loader) for loader in loaders]
        if steps is None:
            for iterator in iterators:
                counts.update(i for b in iterator for i in b.tolist())
            return counts
        for _ in range(steps):
            for iterator in iterators:
                counts.update(next(iterator).tolist())
        state = loaders[0].state_dict()
        del iterators


SCHEDULE = Schedule(
    [(0.0, {"a": 0.8, "b": 0.2}), (0.5, {"a": 0.2, "b": 0.8})], over="samples", total=400
)


@pytest.mark.parametrize("then", [(3, 1), (1, 2)])
@pytest.mark.parametrize("mode", ["weights", "schedule", "tokens"])
def test_stopped_on_2x2_resumed_on_another_shape_reads_every_sample_once(shards, then, mode):
    def build(rank, world):
        if mode == "schedule":
            return MixtureIterable(_sources(shards, rank, world), SCHEDULE, seed=2)
        if mode == "tokens":
            return MixtureIterable(
                _sources(shards, rank, world), {"a": 1, "b": 1}, seed=2, lengths=_tokens
            )
        return MixtureIterable(_sources(shards, rank, world), {"a": 0.6, "b": 0.4}, seed=2)

    counts = _epoch_over_shapes(build, [(2, 2, 7), (*then, None)], batch=4)
    assert sorted(counts) == _all_ids()  # every sample, and each once
    assert set(counts.values()) == {1}


@pytest.mark.parametrize("last", [(3, 1), (3, 2), (2, 0)])
def test_a_rest_stopped_again_goes_on_on_its_own_or_another_shape(shards, last):
    """2 x 2, then 3 x 1 stopped within the rest, then the same ranks (the same or another
    worker count: the rest goes on) or another shape (the rest of the rest dealt)."""

    def build(rank, world):
        return MixtureIterable(_sources(shards, rank, world), SCHEDULE, seed=6)

    counts = _epoch_over_shapes(build, [(2, 2, 5), (3, 1, 3), (*last, None)], batch=4)
    assert sorted(counts) == _all_ids()
    assert set(counts.values()) == {1}


def test_even_sources_repeat_only_each_deals_padding(shards):
    def build(rank, world):
        return MixtureIterable(
            _sources(shards, rank, world, even=True), {"a": 0.5, "b": 0.5}, seed=4
        )

    counts = _epoch_over_shapes(build, [(2, 2, 6), (3, 1, 4), (1, 2, None)], batch=3)
    assert sorted(set(counts)) == _all_ids()  # nothing lost
    # each deal pads each source to equal ranks: at most (2 - 1) + (3 - 1) + 0 per source
    assert sum(counts.values()) - len(_all_ids()) <= 2 * (1 + 2)


def test_a_resume_on_the_same_shape_goes_on_exactly(shards):
    def build(rank, world):
        return MixtureIterable(_sources(shards, rank, world), SCHEDULE, seed=5)

    whole = [b.tolist() for b in StatefulLoader(build(0, 1), batch_size=4, num_workers=2)]
    first = StatefulLoader(build(0, 1), batch_size=4, num_workers=2)
    iterator = iter(first)
    prefix = [next(iterator).tolist() for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    for workers in (2, 0):  # the same workers, or the old workers' order in one process
        resumed = StatefulLoader(build(0, 1), batch_size=4, num_workers=workers)
        resumed.load_state_dict(state)
        assert prefix + [b.tolist() for b in resumed] == whole


@pytest.mark.parametrize("share", [0.5, 0.3, 0.8])
def test_token_shares_hold_within_a_sample_in_a_worker(shards, share):
    mixed = MixtureIterable(_sources(shards), {"a": share, "b": 1 - share}, seed=2, lengths=_tokens)
    got = np.array(list(mixed))
    tokens = np.array([_tokens(i) for i in got])
    from_a = np.cumsum(np.where(got < 1000, tokens, 0))
    from_b = np.cumsum(np.where(got >= 1000, tokens, 0))
    both = min(np.searchsorted(from_a, from_a[-1]), np.searchsorted(from_b, from_b[-1]))
    off = from_a[:both] - share * (from_a + from_b)[:both]
    assert np.abs(off).max() <= 40  # at every sample, within one sample of source b


def test_token_shares_hold_in_what_the_loop_receives(shards):
    mixed = MixtureIterable(_sources(shards), {"a": 1, "b": 1}, seed=1, lengths=_tokens)
    got = [i for b in make_loader(mixed, batch_size=5, num_workers=2) for i in b.tolist()]
    assert sorted(got) == _all_ids()
    tokens = np.array([_tokens(i) for i in got])
    from_a = np.cumsum(np.where(np.array(got) < 1000, tokens, 0))
    both = int(np.searchsorted(from_a, from_a[-1]))  # source a's last sample: both yield before
    gap = 2 * from_a[:both] - np.cumsum(tokens)[:both]  # tokens of a minus tokens of b
    # within about a sample (40 tokens) per worker, and a batch of each worker in flight
    assert np.abs(gap).max() <= 2 * 40 + 5 * 40
    # in samples, source a gives about 4 for every 1 of b
    head = np.array(got[:both])
    assert 3 < (head < 1000).sum() / (head >= 1000).sum() < 5


def test_a_schedule_moves_the_shares_with_progress_over_epochs(shards):
    step = Schedule(
        [(0.0, {"a": 1}), (0.5, {"b": 1})], over="samples", total=392, interpolation="step"
    )
    mixed = MixtureIterable(_sources(shards), step, seed=0, epoch_length=196)
    first = list(mixed)
    assert all(i < 1000 for i in first[:116])  # source a's 116 samples: all before progress 196
    assert all(i >= 1000 for i in first[116:])
    mixed.set_epoch(1)  # epoch 1 starts at 196: source b only, then a once b has ended
    second = list(mixed)
    assert all(i >= 1000 for i in second[:80]) and all(i < 1000 for i in second[80:])
    assert sorted(first) == sorted(second) == _all_ids()


def test_bad_schedules_and_settings_are_refused_at_construction(shards):
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['c'\]"):
        MixtureIterable(_sources(shards), Schedule([(0.0, {"a": 1, "c": 1})], total=10))
    with pytest.raises(ValueError, match="positive sum"):
        MixtureIterable(
            _sources(shards), Schedule([(0.0, {"a": 1}), (0.5, {"a": 0, "b": 0})], total=10)
        )
    with pytest.raises(ValueError, match="increasing order"):
        Schedule([(0.0, {"a": 1}), (0.6, {"b": 1}), (0.4, {"a": 1})], total=10)
    tokens = Schedule([(0.0, {"a": 1, "b": 1})], over="tokens", total=10)
    with pytest.raises(ValueError, match="needs `lengths=`"):
        MixtureIterable(_sources(shards), tokens)
    with pytest.raises(ValueError, match="needs `epoch_length=`"):
        MixtureIterable(_sources(shards), tokens, lengths=_tokens)


def test_fixed_weights_in_samples_draw_as_before(shards):
    """The stream of fixed weights without lengths, frozen from the code before issue 48."""
    mixed = MixtureIterable(_sources(shards), {"a": 0.3, "b": 0.7}, seed=7)
    mixed.set_epoch(3)
    assert list(mixed)[:20] == [
        *[104, 71, 109, 1060, 107, 1008, 1063, 99, 103, 1059, 1000, 1065, 1055, 1052, 1053],
        *[1077, 1019, 1069, 1066, 1070],
    ]


def test_mixtures_and_their_resumed_copies_pickle(shards):
    mixed = MixtureIterable(_sources(shards), SCHEDULE, seed=9, lengths="ids")
    assert pickle.loads(pickle.dumps(mixed)).plan_settings() == mixed.plan_settings()
    plain = MixtureIterable(_sources(shards), {"a": 1, "b": 2}, seed=9, lengths=_tokens)
    rest = plain.resume_after(3, batch_size=4, num_workers=2, reshaped=[[2, 2, 2, 1]])
    assert list(pickle.loads(pickle.dumps(rest))) == list(rest)
    cycling = MixtureIterable(_sources(shards), {"a": 1, "b": 2}, stop="never", num_samples=50)
    assert cycling.resume_after is None and not cycling.reshapes  # read again instead


@settings(max_examples=40, deadline=None)
@given(
    longest=st.lists(st.integers(1, 60), min_size=2, max_size=4),
    raw=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_paced_draws_keep_every_source_within_about_a_sample_of_its_share(longest, raw, seed):
    """While every source yields, each source's units stay within the longest sample of its
    share of the units drawn (samples of random lengths up to each source's longest)."""
    sources = len(longest)
    weights = np.asarray(raw[:sources]) / sum(raw[:sources])
    rng = np.random.default_rng(seed)
    draws = PacedDraws(
        lambda progress: weights[None, :],
        np.random.default_rng(seed + 1),
        Progress(0.0, 1, True),
        np.ones(sources, dtype=bool),
    )
    units = np.zeros(sources)
    active = np.ones(sources, dtype=bool)
    for _ in range(400):
        s = draws.pick(active)
        length = int(rng.integers(1, longest[s] + 1))
        draws.took(s, length)
        units[s] += length
        assert np.abs(units - weights * units.sum()).max() <= 1.0 * max(longest)
