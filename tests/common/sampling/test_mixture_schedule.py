"""Mixture schedules and token shares (issue 48): a 3-phase token schedule over 2 epochs holds
each source's share of every 64k-token window within 2 points of the schedule, counted from the
batches a loop receives; fixed weights with lengths hold token shares; schedules resume
exactly; bad schedules are refused at construction."""

import json
import pickle

import numpy as np
import pytest

from recipes.common import MixtureSampler, Schedule, make_loader
from recipes.common.sampling.mixture_plan import MixturePlan
from tests.common.sampling.mixture_windows import NAMES, collate_items, corpus, window_shares


def test_a_three_phase_token_schedule_holds_every_64k_window_over_two_epochs():
    sizes = [9000, 6000, 3000]
    lengths, data = corpus(sizes)
    per_epoch = 12_000
    total = int(2 * per_epoch * np.mean(np.concatenate(lengths)))
    schedule = Schedule(
        [
            (0.0, {"web": 0.8, "code": 0.2}),
            (0.3, {"web": 0.6, "code": 0.3, "books": 0.1}),
            (0.8, {"web": 0.3, "code": 0.3, "books": 0.4}),
        ],
        over="tokens",
        total=total,
    )
    mix = MixtureSampler(
        dict(zip(NAMES, sizes, strict=True)),
        schedule,
        lengths=dict(zip(NAMES, lengths, strict=True)),
        stop="never",
        num_samples=per_epoch,
        seed=3,
        batch_size=32,
    )
    loader = make_loader(data, batch_sampler=mix, collate_fn=collate_items, num_workers=0)
    ids = []
    tokens = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        for batch in loader:
            ids += [item["id"] for item in batch]
            tokens += [len(item["tokens"]) for item in batch]  # counted from what was received
    ids = np.asarray(ids)
    tokens = np.asarray(tokens)
    sources = np.searchsorted(np.cumsum(sizes), ids, side="right")
    bound = schedule.bind(list(NAMES))
    windows = window_shares(tokens, sources, 64_000)
    assert len(windows) >= 15
    worst = 0.0
    for start, end, shares in windows:
        target = bound.weights_at(np.linspace(start, end, 101)).mean(axis=0)
        worst = max(worst, float(np.abs(shares - target).max()))
    assert worst <= 0.02, worst
    # the phases did move the mixture: books nearly absent at first, the largest at the end
    assert windows[0][2][2] < 0.02 and windows[-1][2][2] > 0.35


def test_fixed_weights_with_lengths_hold_token_shares_not_sample_shares():
    sizes = [4000, 4000]
    rng = np.random.default_rng(1)
    lengths = [rng.integers(10, 30, sizes[0]), rng.integers(100, 300, sizes[1])]
    mix = MixtureSampler(sizes, [0.5, 0.5], lengths=lengths, stop="never", num_samples=3000)
    drawn = np.asarray(list(mix))
    flat = np.concatenate(lengths)
    sources = mix.source_of(drawn)
    token_share = flat[drawn][sources == 0].sum() / flat[drawn].sum()
    assert abs(token_share - 0.5) < 0.01
    assert np.mean(sources == 0) > 0.85  # about 10 short samples for each long one


@pytest.mark.parametrize("stop", ["drop_exhausted", "first_exhausted", "never"])
def test_without_lengths_fixed_weights_draw_the_iid_plan_in_every_epoch(stop):
    """Fixed weights in samples keep the i.i.d. plan of `mixture_plan.py` (the draw recipes had
    before schedules), position for position, in later epochs too; a one-phase schedule is
    paced instead (the same samples of a drop_exhausted epoch, in another order)."""
    num_samples = None
    if stop == "never":
        num_samples = 300
    plain = MixtureSampler([50, 70, 9], [0.3, 0.6, 0.1], seed=4, stop=stop, num_samples=num_samples)
    planner = MixturePlan(
        plain.sizes, plain.weights, stop=stop, num_samples=num_samples, seed=4, shuffle=True
    )
    for epoch in (0, 3):
        plain.set_epoch(epoch)
        assert list(plain) == planner.draw(epoch).indices.tolist()
    paced = MixtureSampler([50, 70, 9], Schedule([(0.0, [0.3, 0.6, 0.1])], total=129), seed=4)
    plain = MixtureSampler([50, 70, 9], [0.3, 0.6, 0.1], seed=4)
    assert sorted(paced) == sorted(plain) == list(range(129))
    assert list(paced) != list(plain)


def test_a_step_schedule_over_samples_switches_at_its_point():
    sizes = [5000, 5000]
    schedule = Schedule([(0.0, [1.0, 0.0]), (0.5, [0.0, 1.0])], total=2000, interpolation="step")
    mix = MixtureSampler(sizes, schedule, stop="never", num_samples=2000)
    sources = mix.source_of(list(mix))
    assert (sources[:1000] == 0).all() and (sources[1000:] == 1).all()


@pytest.mark.parametrize("mode", ["indices", "batches"])
def test_a_scheduled_mixture_resumes_exactly_in_a_later_epoch(mode):
    sizes = [300, 200, 100]
    lengths, data = corpus(sizes, seed=2)
    total = int(3 * 400 * np.mean(np.concatenate(lengths)))
    schedule = Schedule(
        [(0.0, [0.7, 0.3, 0.0]), (0.6, [0.2, 0.3, 0.5])], over="tokens", total=total
    )

    def build():
        batch_size = None
        if mode == "batches":
            batch_size = 8
        mix = MixtureSampler(
            sizes, schedule, lengths=lengths, stop="never", num_samples=400, batch_size=batch_size
        )
        kwargs = {"batch_sampler": mix}
        if batch_size is None:
            kwargs = {"sampler": mix, "batch_size": 8}
        return mix, make_loader(data, collate_fn=collate_items, num_workers=0, **kwargs)

    mix, loader = build()
    whole = []
    for epoch in range(3):
        mix.set_epoch(epoch)
        whole.append([[item["id"] for item in batch] for batch in loader])
    mix, loader = build()
    mix.set_epoch(2)
    iterator = iter(loader)
    got = [[item["id"] for item in next(iterator)] for _ in range(20)]
    state = json.loads(json.dumps(loader.state_dict()))
    mix, loader = build()
    loader.load_state_dict(state)
    got += [[item["id"] for item in batch] for batch in loader]
    assert got == whole[2]


def test_schedules_are_checked_at_construction():
    with pytest.raises(ValueError, match="increasing order"):
        Schedule([(0.0, [1, 1]), (0.5, [1, 0]), (0.2, [0, 1])], total=10)
    with pytest.raises(ValueError, match="first phase must be at 0"):
        Schedule([(0.1, [1, 1])], total=10)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        Schedule([(0.0, [1, 1]), (1.5, [1, 0])], total=10)
    with pytest.raises(ValueError, match="`total` must be a positive integer"):
        Schedule([(0.0, [1, 1])], total=0)
    with pytest.raises(ValueError, match="unknown source"):
        MixtureSampler({"a": 5, "b": 5}, Schedule([(0.0, {"a": 1, "c": 1})], total=10))
    with pytest.raises(ValueError, match="positive sum"):
        MixtureSampler({"a": 5, "b": 5}, Schedule([(0.0, {"a": 1}), (0.5, {"b": 0})], total=10))
    with pytest.raises(ValueError, match="positive sum"):
        MixtureSampler([5, 5], Schedule(_zero_at_the_end, total=10))
    with pytest.raises(ValueError, match="needs each sample's length"):
        MixtureSampler([5, 5], Schedule([(0.0, [1, 1])], over="tokens", total=10))
    with pytest.raises(ValueError, match="over='tokens'"):
        MixtureSampler([5, 5], Schedule([(0.0, [1, 1])], total=10), lengths=[[1] * 5, [2] * 5])
    with pytest.raises(ValueError, match="source '1' has 4 entries"):
        MixtureSampler([5, 5], [1, 1], lengths=[[1] * 5, [2] * 4])
    with pytest.raises(ValueError, match="picklable"):
        Schedule(lambda progress: [1, 1], total=10)


def _zero_at_the_end(progress):
    if progress > 0.9:
        return [0.0, 0.0]
    return [1.0, 1.0]


def _linear(progress):
    return [1.0 - progress, progress]


def test_a_function_schedule_pickles_and_moves_the_shares():
    schedule = Schedule(_linear, total=4000)
    mix = pickle.loads(
        pickle.dumps(MixtureSampler([4000, 4000], schedule, stop="never", num_samples=4000))
    )
    sources = mix.source_of(list(mix))
    assert np.mean(sources[:400] == 1) < 0.1 and np.mean(sources[-400:] == 1) > 0.9


def test_a_source_of_only_zero_length_samples_is_refused_not_a_hang():
    # Issue 48 break: its draws never advance the progress, so a cycling rule drew it forever
    # (cycle_until_all_exhausted hung) and stop="never" drew nothing else.
    lengths = [np.full(50, 10), np.zeros(30, np.int64)]
    for stop, count in (("cycle_until_all_exhausted", None), ("never", 200)):
        with pytest.raises(ValueError, match="source '1' are all 0"):
            MixtureSampler([50, 30], [0.5, 0.5], lengths=lengths, stop=stop, num_samples=count)
    some = [np.full(50, 10), np.r_[np.zeros(29, np.int64), [5]]]  # a few 0-length samples: fine
    mix = MixtureSampler([50, 30], [0.5, 0.5], lengths=some, stop="drop_exhausted")
    assert sorted(mix) == list(range(80))


def test_a_weight_of_zero_under_cycling_ends_the_epoch_as_the_iid_draw_does():
    # Issue 48 break: a source of weight 0 (fixed with lengths, a schedule's last phase, or
    # set_weights) held a paced "cycle_until_all_exhausted" epoch open forever (out of memory).
    ones = [np.ones(50, np.int64), np.ones(30, np.int64)]
    iid = MixtureSampler([50, 30], [0, 1], stop="cycle_until_all_exhausted")
    paced = MixtureSampler([50, 30], [0, 1], lengths=ones, stop="cycle_until_all_exhausted")
    for mix in (iid, paced):
        assert np.bincount(mix.source_of(list(mix)), minlength=2).tolist() == [0, 30]
    late = Schedule([(0.0, [1, 1]), (0.5, [0, 1])], total=40, interpolation="step")
    mix = MixtureSampler([50, 30], late, stop="cycle_until_all_exhausted")
    assert np.bincount(mix.source_of(list(mix))).tolist() == [10, 30]
    mix.set_weights([0, 1])
    mix.set_epoch(1)
    assert np.bincount(mix.source_of(list(mix)), minlength=2).tolist() == [0, 30]
