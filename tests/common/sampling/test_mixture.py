"""MixtureSampler (issue 23): realised counts within binomial bounds of the weights, no repeat
within a source before it is exhausted, the stop rules, disjoint equal ranks, exact resume
through make_loader (workers and threads) in any epoch, elastic batches, a constant-size
state, bucketing of a mixture, and LoaderMonitor's realised proportions. The exactly-once
state machine (test_exactly_once.py) also draws both modes."""

import json
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset

from recipes.common import LengthBucketSampler, LoaderMonitor, MixtureSampler, make_loader


class Range(Dataset):
    def __init__(self, lo, n):
        self.lo, self.n = lo, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.lo + int(i)

    def thread_batches(self):  # its items are arithmetic: the thread path may read them
        return True


def _data(sizes):
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return ConcatDataset([Range(int(o), int(n)) for o, n in zip(offsets, sizes, strict=True)])


def test_counts_follow_the_weights_within_binomial_bounds():
    sizes, weights, n = [1000, 3000, 500], [0.5, 0.3, 0.2], 3000
    for seed in range(5):
        mix = MixtureSampler(sizes, weights, num_samples=n, stop="never", seed=seed)
        counts = np.bincount(mix.source_of(list(mix)), minlength=3)
        assert counts.sum() == n
        for count, w in zip(counts, weights, strict=True):
            assert abs(count - n * w) <= 4 * np.sqrt(n * w * (1 - w)), (seed, counts)


def test_no_index_repeats_within_a_source_before_it_is_exhausted():
    sizes = [7, 40, 13]
    mix = MixtureSampler(sizes, [0.4, 0.3, 0.3], num_samples=400, stop="never", seed=3)
    drawn = np.array(list(mix))
    sources = mix.source_of(drawn)
    for s, n in enumerate(sizes):
        mine = drawn[sources == s]
        for start in range(0, len(mine) - n + 1, n):  # each pass over the source: a permutation
            assert sorted(mine[start : start + n]) == list(
                range(mix.offsets[s], mix.offsets[s] + n)
            )
        tail = mine[len(mine) - len(mine) % n :]
        assert len(set(tail.tolist())) == len(tail)


def test_the_stop_rules_end_epochs_where_they_say():
    sizes, weights = [100, 300, 50], [0.5, 0.3, 0.2]
    every = list(MixtureSampler(sizes, weights, seed=1))  # drop_exhausted: every sample once
    assert Counter(every) == Counter(range(450))
    first = MixtureSampler(sizes, weights, stop="first_exhausted", seed=1)
    drawn = np.array(list(first))
    counts = np.bincount(first.source_of(drawn), minlength=3)
    exhausted = int(np.flatnonzero(counts == np.array(sizes))[0])
    assert (counts <= sizes).all() and (
        counts == sizes
    ).sum() == 1  # one source ran out, the others did not
    assert first.source_of(drawn[-1:])[0] == exhausted  # the epoch ends at its last sample
    capped = list(MixtureSampler(sizes, weights, num_samples=120, seed=1))
    assert len(capped) == 120 and len(set(capped)) == 120
    with pytest.raises(ValueError, match="give `num_samples`"):
        MixtureSampler(sizes, weights, stop="never")
    with pytest.raises(ValueError, match="every source needs samples"):
        MixtureSampler({"a": 3, "b": 0}, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match="same sources"):
        MixtureSampler({"a": 3, "b": 4}, {"a": 1, "c": 1})
    with pytest.raises(ValueError, match="`stop` must be one of"):
        MixtureSampler(sizes, weights, stop="sometimes")
    with pytest.raises(ValueError, match="ambiguous.*cycle_until_all_exhausted.*drop_exhausted"):
        MixtureSampler(
            sizes, weights, stop="all_exhausted"
        )  # HF's name, another meaning: named, never guessed
    zero = MixtureSampler(sizes, [0.5, 0.5, 0.0], seed=2)  # a weight of 0: never drawn
    assert 2 not in set(zero.source_of(list(zero)).tolist())


def _stop_facts(sources: np.ndarray, sizes: np.ndarray, rule: str) -> bool:
    """What a stop rule promises of one epoch's sequence of sources, whatever the seed."""
    counts = np.bincount(sources, minlength=len(sizes))
    last = int(sources[-1])
    if rule == "first_exhausted":  # the first source to give its last sample ends the epoch with it
        return counts[last] == sizes[last] and int((counts >= sizes).sum()) == 1
    # every source seen whole; the epoch ends with the last one's last sample of its first pass
    return bool((counts >= sizes).all()) and counts[last] == sizes[last]


@pytest.mark.parametrize(
    "rule, hf_rule",
    [("first_exhausted", "first_exhausted"), ("cycle_until_all_exhausted", "all_exhausted")],
)
def test_stop_rules_count_as_hugging_face_datasets_does(rule, hf_rule):
    """Issue #27: the rule that HF calls `all_exhausted` (cycle until every source was seen
    whole) is `cycle_until_all_exhausted` here; `first_exhausted` means the same in both. The
    plans differ by seed, so what is compared is what no seed changes (each epoch's ending,
    every source's count against its size) and the mean counts over many seeds."""
    datasets = pytest.importorskip("datasets")
    sizes, weights = np.array([30, 120, 12]), [0.5, 0.3, 0.2]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parts = [
        datasets.Dataset.from_dict({"i": list(range(o, o + n))})
        for o, n in zip(offsets, sizes, strict=True)
    ]
    ours, theirs = [], []
    for seed in range(100):
        mix = MixtureSampler(sizes.tolist(), weights, stop=rule, seed=seed)
        plan = np.array(list(mix))
        hf = np.array(
            datasets.interleave_datasets(
                parts, probabilities=weights, seed=seed, stopping_strategy=hf_rule
            )["i"]
        )
        for got, counted in ((mix.source_of(plan), ours), (mix.source_of(hf), theirs)):
            assert _stop_facts(got, sizes, rule), (seed, np.bincount(got, minlength=3))
            counted.append(np.bincount(got, minlength=3))
        if (
            rule == "cycle_until_all_exhausted"
        ):  # every sample once before any sample twice, per source
            for s in range(3):
                mine = plan[mix.source_of(plan) == s]
                assert Counter(mine[: sizes[s]].tolist()) == Counter(
                    range(offsets[s], offsets[s] + sizes[s])
                )
    ours, theirs = np.mean(ours, axis=0), np.mean(theirs, axis=0)
    assert ours.sum() == pytest.approx(theirs.sum(), rel=0.08)  # the epoch's expected length
    assert ours == pytest.approx(theirs, rel=0.12)  # and each source's expected count


def test_cycled_iterables_end_when_every_source_has_ended_once(tmp_path):
    from recipes.common import MixtureIterable

    small, large = _shard_sets(tmp_path, [10, 90])
    mixed = MixtureIterable([small, large], [0.5, 0.5], stop="cycle_until_all_exhausted", seed=4)
    got = np.array([int(i) for i in mixed])
    counts = Counter(got.tolist())
    assert set(counts) == set(range(100))  # every sample of both, the small source several times
    assert all(counts[i] == 1 for i in range(10, 100)) and sum(counts[i] for i in range(10)) > 10
    assert abs((got < 10).mean() - 0.5) < 0.15  # the proportions hold throughout
    with pytest.raises(ValueError, match="give `num_samples`"):
        MixtureSampler([5, 10**9], [1.0, 1e-9], stop="cycle_until_all_exhausted")


def test_weights_whose_sum_overflows_are_refused():
    with pytest.raises(ValueError, match="sum to infinity.*scale them down"):
        MixtureSampler([5, 5], [1e308, 1e308])


def test_ranks_are_disjoint_equal_and_cover_the_plan():
    for world in (2, 3):
        ranks = [
            MixtureSampler([30, 47], [0.7, 0.3], seed=4, num_replicas=world, rank=r)
            for r in range(world)
        ]
        for epoch in (0, 5):
            for mix in ranks:
                mix.set_epoch(epoch)
            got = [list(mix) for mix in ranks]
            assert len({len(g) for g in got}) == 1
            plan = ranks[0].global_indices().tolist()
            together = [i for position in zip(*got, strict=True) for i in position]
            assert (
                together[: len(plan)] == plan and len(together) - len(plan) < world
            )  # padding only to even
    a, b = (
        MixtureSampler([30, 47], [0.7, 0.3], seed=4),
        MixtureSampler([30, 47], [0.7, 0.3], seed=4),
    )
    b.set_epoch(1)
    assert list(a) != list(b)  # each epoch its own plan


@pytest.mark.parametrize("path", ["workers", "threads", "isolated"])
@pytest.mark.parametrize("epoch", [0, 1, 2])
@pytest.mark.parametrize("cut", [0, 3, 11])
def test_a_resume_at_any_batch_in_any_epoch_is_the_uninterrupted_run(path, epoch, cut):
    sizes = [20, 37, 9]

    def build():
        mix = MixtureSampler(
            dict(zip("abc", sizes, strict=True)),
            {"a": 0.5, "b": 0.3, "c": 0.2},
            num_samples=48,
            stop="never",
            seed=8,
        )
        settings = dict(num_workers=2) if path == "workers" else dict(path=path)
        return make_loader(_data(sizes), batch_size=4, sampler=mix, **settings), mix

    whole, mix = build()
    expected = []
    for e in range(epoch + 2):
        mix.set_epoch(e)
        expected.append([b.tolist() for b in whole])
    first, mix = build()
    for e in range(epoch):
        mix.set_epoch(e)
        list(first)
    mix.set_epoch(epoch)
    iterator = iter(first)
    prefix = [next(iterator).tolist() for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    second, mix2 = build()
    mix2.set_epoch(epoch)
    second.load_state_dict(state)
    rest = [b.tolist() for b in second]
    assert Counter(i for b in prefix + rest for i in b) == Counter(
        i for b in expected[epoch] for i in b
    )
    assert prefix + rest == expected[epoch]
    mix2.set_epoch(epoch + 1)
    assert [b.tolist() for b in second] == expected[epoch + 1]


def test_batches_resume_on_another_number_of_ranks():
    """Batch mode, 2 ranks to 1 mid-epoch: every global batch of the epoch once (the ranks'
    padding aside), as LengthBucketSampler."""
    sizes = [25, 40]

    def loader(world, rank):
        mix = MixtureSampler(sizes, [0.6, 0.4], seed=5, batch_size=4, num_replicas=world, rank=rank)
        mix.set_epoch(1)
        return make_loader(_data(sizes), batch_sampler=mix, num_workers=0), mix

    plan = [b.tolist() for b in loader(1, 0)[1]._global_batches(1)]
    two = [loader(2, r)[0] for r in range(2)]
    iterators = [iter(x) for x in two]
    got = [next(it).tolist() for _ in range(3) for it in iterators]
    state = json.loads(json.dumps(two[0].state_dict()))
    one, _ = loader(1, 0)
    one.load_state_dict(state)
    got += [b.tolist() for b in one]
    assert Counter(map(tuple, got)) == Counter(map(tuple, plan))


def test_the_state_is_small_and_does_not_grow():
    """O(sources): the loader's state after 1 batch and after 20,000 samples is the same size."""
    sizes = [30_000, 90_000]
    mix = MixtureSampler(sizes, [0.5, 0.5], num_samples=40_000, stop="never", seed=1)
    loader = make_loader(_data(sizes), batch_size=500, sampler=mix, num_workers=0)
    iterator = iter(loader)
    lengths = []
    for done in (1, 40):
        while len(lengths) < done:
            next(iterator)
            lengths.append(None)
        lengths[-1] = len(json.dumps(loader.state_dict()))
    # the same but for the digits of the batch count (1 -> 40) and of the samples done (500 ->
    # 20,000)
    assert (
        lengths[-1] - lengths[0] == len("40") - len("1") + len("20000") - len("500")
        and lengths[0] < 4000
    ), lengths


def test_mix_first_then_bucket_and_the_monitor_reports_the_mixture():
    sizes = [60, 200]
    lengths = np.random.default_rng(0).integers(4, 80, sum(sizes))
    mix = MixtureSampler(
        {"books": 60, "web": 200},
        {"books": 0.5, "web": 0.5},
        num_samples=200,
        stop="never",
        seed=2,
        num_replicas=1,
        rank=0,
    )
    bucket = LengthBucketSampler(lengths, max_tokens=400, seed=3, mixture=mix)
    bucket.set_epoch(1)
    plan = mix.global_indices(1)
    batches = list(bucket)
    assert Counter(i for b in batches for i in b) == Counter(
        plan.tolist()
    )  # the mixture's samples, bucketed
    assert all(len(b) * max(lengths[b]) <= 400 or len(b) == 1 for b in batches)
    with pytest.raises(ValueError, match="num_replicas=1"):
        LengthBucketSampler(
            lengths, max_tokens=400, mixture=MixtureSampler(sizes, [1, 1], num_replicas=2, rank=0)
        )
    monitor = LoaderMonitor(
        make_loader(_data(sizes), batch_sampler=bucket, num_workers=0), warn_wait_fraction=1.0
    )
    bucket.set_epoch(1)
    for _ in monitor:
        pass
    shares = monitor.summary()["sources"]
    counts = np.bincount(mix.source_of(plan), minlength=2)
    assert shares == pytest.approx({"books": counts[0] / 200, "web": counts[1] / 200})
    plain = MixtureSampler({"a": 20, "b": 30}, {"a": 0.8, "b": 0.2}, seed=1)
    monitored = LoaderMonitor(
        make_loader(_data([20, 30]), batch_size=5, sampler=plain, num_workers=0),
        warn_wait_fraction=1.0,
    )
    for _ in monitored:
        pass
    assert monitored.summary()["sources"] == pytest.approx(
        {"a": 0.4, "b": 0.6}
    )  # all_exhausted: every sample


def test_the_loader_takes_the_thread_path_and_torch_seeds_nothing():
    mix = MixtureSampler([10, 10], [0.5, 0.5], seed=0)
    torch.manual_seed(0)
    a = [b.tolist() for b in make_loader(_data([10, 10]), batch_size=4, sampler=mix, num_workers=0)]
    torch.manual_seed(1)
    b = [b.tolist() for b in make_loader(_data([10, 10]), batch_size=4, sampler=mix, num_workers=0)]
    assert a == b  # the plan is the sampler's, from (seed, epoch)


def _shard_sets(tmp_path, sizes, per_shard=10):
    """One ShardedIterableDataset per source: integer samples in text shards of `per_shard`."""
    from recipes.common import ShardedIterableDataset

    sets, start = [], 0
    for s, n in enumerate(sizes):
        paths, lengths = [], []
        for k, lo in enumerate(range(start, start + n, per_shard)):
            hi = min(start + n, lo + per_shard)
            path = tmp_path / f"src{s}-{k}.txt"
            path.write_text(" ".join(map(str, range(lo, hi))))
            paths.append(str(path))
            lengths.append(hi - lo)
        sets.append(
            ShardedIterableDataset(
                paths,
                lambda p, a, b: [int(x) for x in open(p).read().split()][a:b],
                shard_lengths=lengths,
                seed=s,
            )
        )
        start += n
    return sets


def test_iterable_sources_interleave_by_weight_each_exact_over_workers(tmp_path):
    from recipes.common import MixtureIterable

    sizes = [60, 140]
    mixed = MixtureIterable(
        {"a": _shard_sets(tmp_path, sizes)[0], "b": _shard_sets(tmp_path, sizes)[1]},
        {"a": 0.5, "b": 0.5},
        seed=3,
    )
    for epoch in range(2):
        mixed.set_epoch(epoch)
        got = [int(i) for b in make_loader(mixed, batch_size=8, num_workers=2) for i in b]
        assert Counter(got) == Counter(range(200)), (
            epoch
        )  # drop_exhausted: every sample of both once
        head = np.array(got[:80])
        assert 0.35 < (head < 60).mean() < 0.65  # 0.5 / 0.5 while both sources yield
    never = MixtureIterable(
        _shard_sets(tmp_path, [20, 200]), [0.5, 0.5], stop="never", num_samples=120, seed=1
    )
    got = [int(i) for b in make_loader(never, batch_size=8, num_workers=2) for i in b]
    assert (
        len(got) == 120 and abs((np.array(got) < 20).mean() - 0.5) < 0.2
    )  # the small source restarts
    loader = make_loader(
        mixed, batch_size=8, num_workers=2
    )  # exact resume (by replaying the prefix)
    mixed.set_epoch(5)
    whole = [b.tolist() for b in loader]
    mixed.set_epoch(5)
    iterator = iter(loader)
    prefix = [next(iterator).tolist() for _ in range(7)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make_loader(mixed, batch_size=8, num_workers=2)
    mixed.set_epoch(5)
    resumed.load_state_dict(state)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert prefix + [b.tolist() for b in resumed] == whole
    two_ranks = _shard_sets(tmp_path, sizes)
    for d in two_ranks:
        d.world_size, d.rank = 2, 0
    with pytest.raises(ValueError, match="ends each rank's stream at a different step"):
        MixtureIterable(two_ranks, [1, 1], stop="first_exhausted")


def test_mixture_sources_read_a_batch_part_by_part_in_order():
    from recipes.common import MixtureSources

    class Batched(Range):
        calls = 0

        def __getitems__(self, indices):
            Batched.calls += 1
            return [self.lo + i for i in indices]

    sources = MixtureSources([Batched(0, 5), Range(100, 7), Batched(200, 3)])
    plain = ConcatDataset([Range(0, 5), Range(100, 7), Range(200, 3)])
    rng = np.random.default_rng(0)
    for _ in range(50):
        indices = rng.integers(-15, 15, int(rng.integers(1, 20))).tolist()
        assert sources.__getitems__(indices) == [plain[i] for i in indices]
    Batched.calls = 0
    sources.__getitems__([0, 14, 1, 13])
    assert Batched.calls == 2  # one call per part that has indices


def test_iterable_mixtures_follow_the_epoch_in_persistent_workers_and_resume_in_later_epochs(
    tmp_path,
):
    from recipes.common import MixtureIterable

    def build():
        return MixtureIterable(_shard_sets(tmp_path, [60, 140]), [0.5, 0.5], seed=3)

    mixed = build()
    loader = make_loader(mixed, batch_size=8, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(3):
        mixed.set_epoch(epoch)
        epochs.append([b.tolist() for b in loader])
    patterns = [tuple(i < 60 for b in e for i in b) for e in epochs]
    assert len(set(patterns)) == 3  # a new interleave every epoch, also in persistent workers
    again = build()
    resumed = make_loader(again, batch_size=8, num_workers=2, persistent_workers=True)
    again.set_epoch(2)
    iterator = iter(resumed)
    prefix = [next(iterator).tolist() for _ in range(5)]
    state = json.loads(json.dumps(resumed.state_dict()))
    del iterator
    third = build()
    rest_loader = make_loader(third, batch_size=8, num_workers=2)
    third.set_epoch(2)
    rest_loader.load_state_dict(state)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert prefix + [b.tolist() for b in rest_loader] == epochs[2]
    # another worker count (issue 48): the rest of the old workers' streams, in their order
    other = make_loader(build(), batch_size=8, num_workers=0)
    other.dataset.set_epoch(2)
    other.load_state_dict(state)
    assert prefix + [b.tolist() for b in other] == epochs[2]


def test_iterable_never_gives_every_rank_the_same_count(tmp_path):
    from recipes.common import MixtureIterable

    for n in (5, 101):
        counts = []
        for rank in range(2):
            sets = _shard_sets(tmp_path, [20, 30])
            for d in sets:
                d.world_size, d.rank, d.even = 2, rank, True
            counts.append(
                len(list(MixtureIterable(sets, [0.5, 0.5], stop="never", num_samples=n, seed=1)))
            )
        assert counts[0] == counts[1] == -(-n // 2), (n, counts)


def test_numpy_arguments_keep_the_state_json_and_bad_arguments_are_named():
    sizes = np.array([30, 40])
    mix = MixtureSampler(
        sizes, np.array([0.5, 0.5]), num_samples=sizes.sum(), stop="never", seed=np.int64(2)
    )
    loader = make_loader(_data([30, 40]), batch_size=4, sampler=mix, num_workers=0)
    iterator = iter(loader)
    next(iterator)
    json.dumps(loader.state_dict())
    for kwargs, message in (
        ({"num_samples": 1e3}, "`num_samples` must be an integer"),
        ({"num_samples": True}, "`num_samples` must be an integer"),
        ({"seed": -1}, "`seed` must be an integer of at least 0"),
        ({"batch_size": 0}, "`batch_size` must be an integer of at least 1"),
    ):
        with pytest.raises(ValueError, match=message):
            MixtureSampler([3, 4], [1, 1], **kwargs)
    with pytest.raises(ValueError, match="whole numbers"):
        MixtureSampler([3.7, 4], [1, 1])
    with pytest.raises(ValueError, match="both as mappings"):
        MixtureSampler([3, 4], {"a": 1, "b": 1})
    tiny = MixtureSampler([1, 1000], [0.5, 0.5], num_samples=200_000, stop="never", seed=0)
    assert (
        np.bincount(tiny.source_of(tiny.global_indices()))[0] > 90_000
    )  # one array operation, not 10^5 generators
    with pytest.raises(
        ValueError, match="`lengths` has 5 entries but the mixture's sources hold 7"
    ):
        LengthBucketSampler(
            np.ones(5, int),
            max_tokens=10,
            mixture=MixtureSampler([3, 4], [1, 1], num_replicas=1, rank=0),
        )
    from recipes.common import MixtureSources

    with pytest.raises(IndexError, match="index 15 is out of range"):
        MixtureSources([Range(0, 5), Range(5, 10)]).__getitems__([15])
    for huge in (2**63, -(2**64)):  # beyond int64: still the IndexError, naming the index
        with pytest.raises(IndexError, match=f"index {huge} is out of range"):
            MixtureSources([Range(0, 5), Range(5, 10)]).__getitems__([0, huge])


def test_the_monitor_reports_what_a_resumed_epoch_delivered():
    sizes = [10, 100]

    def build():
        mix = MixtureSampler({"a": 10, "b": 100}, {"a": 0.5, "b": 0.5}, seed=4)
        return make_loader(_data(sizes), batch_size=4, sampler=mix, num_workers=0), mix

    first, _ = build()
    iterator = iter(first)
    for _ in range(10):
        next(iterator)
    state = first.state_dict()
    del iterator
    second, mix = build()
    second.load_state_dict(state)
    monitor = LoaderMonitor(second, warn_wait_fraction=1.0)
    delivered = [i for b in monitor for i in b.tolist()]
    shares = monitor.summary()["sources"]
    assert shares["a"] == pytest.approx(sum(i < 10 for i in delivered) / len(delivered))
