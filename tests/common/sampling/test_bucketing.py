import json
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes.common import LengthBucketSampler


def _cost(sampler, lengths, batch):
    return len(batch) * sampler.padded_length(max(lengths[i] for i in batch))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), max_size=150),
    batch_size=st.one_of(st.none(), st.integers(1, 20)),
    max_tokens=st.integers(1, 2000),
    multiple=st.sampled_from([1, 8]),
    shuffle=st.booleans(),
)
def test_single_replica_covers_every_sample_once_within_limits(
    lengths, batch_size, max_tokens, multiple, shuffle
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = LengthBucketSampler(
            lengths,
            batch_size=batch_size,
            max_tokens=max_tokens,
            pad_to_multiple_of=multiple,
            shuffle=shuffle,
            seed=3,
        )
        batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert len(batches) == len(s)
    for b in batches:
        assert b, "no empty batch"
        if batch_size is not None:
            assert len(b) <= batch_size
        assert _cost(s, lengths, b) <= max_tokens or len(b) == 1


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), max_size=120),
    world=st.integers(1, 4),
    max_tokens=st.integers(100, 800),
    drop_last=st.booleans(),
)
def test_ranks_are_equal_disjoint_and_cover_the_data(lengths, world, max_tokens, drop_last):
    per_rank = [
        list(
            LengthBucketSampler(
                lengths,
                max_tokens=max_tokens,
                num_replicas=world,
                rank=r,
                drop_last=drop_last,
                seed=1,
            )
        )
        for r in range(world)
    ]
    assert len({len(b) for b in per_rank}) == 1  # the same number of batches on every rank
    global_batches = LengthBucketSampler(lengths, max_tokens=max_tokens, seed=1).global_batches()
    seen = [i for rank in per_rank for b in rank for i in b]
    if drop_last:
        assert len(seen) == len(set(seen))  # nothing repeated
        dropped = global_batches[len(global_batches) - len(global_batches) % world :]
        assert set(range(len(lengths))) - set(seen) == {int(i) for b in dropped for i in b}
    else:
        assert set(seen) == set(range(len(lengths)))  # every sample
        padding = sum(len(b) for rank in per_rank for b in rank) - len(lengths)
        pad_batches = (-len(global_batches)) % world
        assert padding == sum(
            len(global_batches[i % max(len(global_batches), 1)]) for i in range(pad_batches)
        )


def test_deterministic_and_reshuffled_by_set_epoch():
    lengths = np.random.default_rng(0).integers(1, 200, 500)
    a = LengthBucketSampler(lengths, max_tokens=1024, seed=5)
    b = LengthBucketSampler(lengths, max_tokens=1024, seed=5)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)


def test_batch_order_is_not_monotonic_but_batches_are_homogeneous():
    lengths = np.random.default_rng(1).lognormal(4, 0.9, 2000).astype(int) + 1
    s = LengthBucketSampler(lengths, max_tokens=4096, seed=0)
    maxima = [lengths[b].max() for b in s]
    assert maxima != sorted(maxima) and maxima != sorted(maxima, reverse=True)
    padded = sum(len(b) * lengths[b].max() for b in s)
    assert 1 - lengths.sum() / padded < 0.05  # bucketing waste on long-tailed lengths
    random_batches = np.random.default_rng(0).permutation(len(lengths)).reshape(-1, 40)
    random_padded = sum(len(b) * lengths[b].max() for b in random_batches)
    assert 1 - lengths.sum() / random_padded > 0.4


def test_sample_longer_than_the_budget_is_alone_and_warned_once():
    with pytest.warns(UserWarning, match="over max_tokens=100") as record:
        batches = list(LengthBucketSampler([5, 500, 600, 7], max_tokens=100, seed=0))
    assert len([w for w in record if "max_tokens" in str(w.message)]) == 1
    assert sorted(batches) == [[0, 3], [1], [2]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "needs `batch_size`, `max_tokens` or both"),
        ({"max_tokens": 0}, "`max_tokens` must be positive, but is 0 instead."),
        (
            {"batch_size": 4, "num_replicas": 2, "rank": 2},
            r"`rank` must be in \[0, 2\), but is 2 instead.",
        ),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LengthBucketSampler([1, 2, 3], **kwargs)


def _run(lengths, world, epoch=0, state=None, stop_after=None):
    """Batches per rank; with `stop_after`, also the state saved after that many steps."""
    out, states = [], []
    for rank in range(world):
        s = LengthBucketSampler(lengths, max_tokens=300, num_replicas=world, rank=rank, seed=9)
        s.set_epoch(epoch)
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))
        batches = []
        for step, batch in enumerate(s):
            if stop_after is not None and step == stop_after:
                break
            batches.append(batch)
        out.append(batches)
        states.append(s.state_dict(batches_done=len(batches)))
    return out, states


@pytest.mark.parametrize("stop_after", [0, 1, 4, 9])
def test_resume_equals_the_uninterrupted_run(stop_after):
    lengths = np.random.default_rng(2).integers(1, 100, 300).tolist()
    full, _ = _run(lengths, 2, epoch=3)
    head, states = _run(lengths, 2, epoch=3, stop_after=stop_after)
    assert states[0] == states[1]
    tail, _ = _run(lengths, 2, epoch=3, state=states[0])
    for rank in range(2):
        assert head[rank] + tail[rank] == full[rank]


@pytest.mark.parametrize("old, new", [(2, 3), (3, 1), (1, 4)])
def test_elastic_resume_loses_and_repeats_nothing(old, new):
    lengths = np.random.default_rng(4).integers(1, 100, 400).tolist()
    head, states = _run(lengths, old, epoch=1, stop_after=3)
    tail, _ = _run(lengths, new, epoch=1, state=states[0])
    assert len({len(t) for t in tail}) == 1  # equal counts on the new world
    seen = [i for part in (head, tail) for rank in part for b in rank for i in b]
    assert set(seen) == set(range(len(lengths)))
    global_count = len(LengthBucketSampler(lengths, max_tokens=300, seed=9).global_batches())
    remaining = global_count - 3 * old
    max_repeat_batches = (-remaining) % new
    repeats = len(seen) - len(set(seen))
    assert repeats <= max_repeat_batches * max(lengths), "only documented padding repeats"


def test_state_after_the_end_gives_an_empty_rest_and_next_epoch_is_full():
    lengths = list(range(1, 60))
    s = LengthBucketSampler(lengths, max_tokens=200, seed=0)
    n = len(list(s))
    state = s.state_dict()
    assert state["global_batches_done"] == n
    resumed = LengthBucketSampler(lengths, max_tokens=200, seed=0)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    resumed.set_epoch(1)
    assert len(list(resumed)) == n


def test_state_for_other_data_is_refused():
    s = LengthBucketSampler([1, 2, 3], batch_size=2)
    with pytest.raises(ValueError, match="num_samples=3 .saved. vs 2.*same data and settings"):
        LengthBucketSampler([1, 2], batch_size=2).load_state_dict(s.state_dict())


@pytest.mark.parametrize(
    "change",
    [
        {"lengths": [1, 2, 4]},
        {"seed": 1},
        {"shuffle": False},
        {"batch_size": 3},
        {"max_tokens": 8},
        {"pad_to_multiple_of": 2},
        {"drop_last": True},
    ],
)
def test_a_state_under_any_other_plan_setting_is_refused(change):
    """Everything that shapes the epoch's batches is carried by the state and checked."""
    settings = {
        "lengths": [1, 2, 3],
        "seed": 0,
        "shuffle": True,
        "batch_size": 2,
        "max_tokens": None,
        "pad_to_multiple_of": 1,
        "drop_last": False,
    }
    state = LengthBucketSampler(settings.pop("lengths"), **settings).state_dict(batches_done=0)
    other = {"lengths": [1, 2, 3], **settings, **change}
    with pytest.raises(ValueError, match=f"{next(iter(change))}=.*same data and settings"):
        LengthBucketSampler(other.pop("lengths"), **other).load_state_dict(state)


def test_warns_when_set_epoch_is_forgotten_across_replicas():
    s = LengthBucketSampler(list(range(1, 50)), batch_size=4, num_replicas=2, rank=0)
    list(s)
    with pytest.warns(UserWarning, match="call sampler.set_epoch"):
        list(s)
    s.set_epoch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)


def test_pickles():
    s = LengthBucketSampler(np.arange(1, 100), max_tokens=256, num_replicas=2, rank=1, seed=4)
    s.set_epoch(2)
    assert list(pickle.loads(pickle.dumps(s))) == list(s)


def test_state_after_a_resumed_pass_counts_the_resumed_part():
    lengths = list(range(1, 80))
    first = LengthBucketSampler(lengths, max_tokens=150, num_replicas=2, rank=0, seed=2)
    head = []
    for batch in first:
        head.append(batch)
        if len(head) == 3:
            break
    saved = first.state_dict(batches_done=3)
    resumed = LengthBucketSampler(lengths, max_tokens=150, num_replicas=2, rank=0, seed=2)
    resumed.load_state_dict(saved)
    assert resumed.state_dict(batches_done=0) == saved  # before iterating: the pending position
    rest = list(resumed)
    total = len(resumed.global_batches())
    assert resumed.state_dict()["global_batches_done"] == min(
        total, saved["global_batches_done"] + 2 * len(rest)
    )
    again = LengthBucketSampler(lengths, max_tokens=150, num_replicas=2, rank=0, seed=2)
    again.load_state_dict(resumed.state_dict())
    assert list(again) == []  # the epoch is done; nothing repeats


def test_a_loaded_position_survives_set_epoch_to_its_epoch_after_iter():
    """A loop that loads a state, calls `iter()`, then `set_epoch(epoch)` of the same epoch (no
    workers: nothing is drawn at `iter()`) continues where the state was, as with workers."""
    from recipes.common import make_loader

    lengths = np.random.default_rng(1).integers(1, 40, 90)

    def build():
        sampler = LengthBucketSampler(lengths, max_tokens=120, seed=2, num_replicas=2, rank=0)
        sampler.set_epoch(1)
        return make_loader(list(range(90)), batch_sampler=sampler, num_workers=0, collate_fn=list)

    whole = list(build())
    first = build()
    iterator = iter(first)
    head = [next(iterator) for _ in range(3)]
    state = first.state_dict()
    del iterator
    resumed = build()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    resumed.batch_sampler.set_epoch(1)
    assert head + list(iterator) == whole
