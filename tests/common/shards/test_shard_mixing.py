"""Sample-level mixing on the shard path: batches of sorted input mix like an i.i.d. shuffle,
epochs differ, and a resume is exact (issue 37)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from recipes.common import ShardedIterableDataset, ShardSet, make_loader, write_shards
from recipes.common.shards.epochs.shard_mixing import mixing_schedule, shuffled_samples, skip_counts

CLASSES, PER_CLASS, BATCH = 15, 48, 32


def sorted_photos_like(seed: int = 0):
    """720 samples of 15 classes in class order (an ImageFolder listed sorted), each with a
    payload of a photograph's size (60-120 KB), as the README writes them."""
    rng = np.random.default_rng(seed)
    return [
        {
            "__key__": f"{i:06d}",
            "jpg": rng.bytes(int(rng.integers(60_000, 120_000))),
            "cls": i // PER_CLASS,
        }
        for i in range(CLASSES * PER_CLASS)
    ]


def batch_mix(batches: list[list[int]]) -> tuple[float, float]:
    """(mean distinct labels per full batch, mean share of its most common label)."""
    full = [b for b in batches if len(b) == BATCH]
    distinct = np.mean([len(set(b)) for b in full])
    majority = np.mean([Counter(b).most_common(1)[0][1] / len(b) for b in full])
    return float(distinct), float(majority)


def iid_mix(labels: list[int], rounds: int = 200) -> tuple[float, float]:
    """The same metric over i.i.d. permutations of the same labels: the reference."""
    rng = np.random.default_rng(123)
    full = len(labels) // BATCH * BATCH
    runs = [
        batch_mix(rng.permutation(labels)[:full].reshape(-1, BATCH).tolist()) for _ in range(rounds)
    ]
    return float(np.mean([r[0] for r in runs])), float(np.mean([r[1] for r in runs]))


def epoch_labels(loader, ds, epoch):
    ds.set_epoch(epoch)
    return [batch["cls"].tolist() for batch in loader]


@pytest.mark.parametrize(
    "shard_bytes", [64 * 2**20, 256 * 2**10], ids=["default-one-shard", "readme-256KiB"]
)
def test_the_readme_way_mixes_like_iid_and_epochs_differ(tmp_path, shard_bytes):
    """Sorted input written as the README writes it (write_shards' defaults but the shard size),
    read with the defaults through two workers: batches hold about as many classes as an i.i.d.
    shuffle's (within 15%), their most common class at most 1.5x i.i.d.'s share."""
    samples = sorted_photos_like()
    shards = write_shards(iter(samples), tmp_path / "s", shard_bytes=shard_bytes, progress=False)
    ds = shards.dataset(shuffle=True)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2)
    first, second = epoch_labels(loader, ds, 0), epoch_labels(loader, ds, 1)
    iid_distinct, iid_majority = iid_mix([s["cls"] for s in samples])
    for batches in (first, second):
        assert sorted(x for b in batches for x in b) == sorted(s["cls"] for s in samples)
        distinct, majority = batch_mix(batches)
        assert distinct >= 0.85 * iid_distinct, (distinct, iid_distinct, len(shards.entries))
        assert majority <= 1.5 * iid_majority, (majority, iid_majority)
    assert first != second


def test_read_side_mixing_alone_mixes_shards_of_one_class_each(tmp_path):
    """Shards another tool wrote in class order (one class per shard): shard order alone gives
    batches of one or two classes; the window mixes each batch over many shards."""
    samples = sorted_photos_like()
    shards = write_shards(samples, tmp_path / "s", shard_bytes=2**20, progress=False, shuffle=False)
    labels = [s["cls"] for s in samples]
    plain = shards.dataset(shuffle_window=0, seed=1)
    mixed = shards.dataset(seed=1)
    plain_distinct, _ = batch_mix(epoch_labels(DataLoader(plain, batch_size=BATCH), plain, 0))
    distinct, majority = batch_mix(epoch_labels(DataLoader(mixed, batch_size=BATCH), mixed, 0))
    iid_distinct, iid_majority = iid_mix(labels)
    assert (
        plain_distinct < 0.6 * iid_distinct
    )  # the failure the mixing fixes: a few classes per batch
    assert distinct >= 0.7 * iid_distinct and majority <= 2 * iid_majority, (
        distinct,
        majority,
        iid_distinct,
    )


def test_a_resume_with_two_workers_at_batch_7_of_epoch_1_is_the_uninterrupted_order(tmp_path):
    samples = sorted_photos_like()
    shards = write_shards(samples, tmp_path / "s", shard_bytes=256 * 2**10, progress=False)

    def build():
        ds = shards.dataset(seed=3, transform=lambda s: s["cls"] * 10_000 + int(s["__key__"]))
        return make_loader(ds, batch_size=8, num_workers=2), ds

    whole, ds = build()
    expected = [epoch_labels_plain(whole, ds, e) for e in range(3)]
    first, ds = build()
    epoch_labels_plain(first, ds, 0)
    ds.set_epoch(1)
    iterator = iter(first)
    prefix = [next(iterator).tolist() for _ in range(7)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    second, ds2 = build()
    ds2.set_epoch(1)
    second.load_state_dict(state)
    rest = [b.tolist() for b in second]
    assert prefix + rest == expected[1]
    counts = Counter(x for b in prefix + rest for x in b)
    assert len(counts) == len(samples) and set(counts.values()) == {1}
    assert epoch_labels_plain(second, ds2, 2) == expected[2]


def epoch_labels_plain(loader, ds, epoch):
    ds.set_epoch(epoch)
    return [b.tolist() for b in loader]


def test_two_ranks_read_every_sample_once_and_each_ranks_batches_mix(tmp_path):
    samples = sorted_photos_like()
    shards = write_shards(samples, tmp_path / "s", shard_bytes=256 * 2**10, progress=False)
    iid_distinct, _ = iid_mix([s["cls"] for s in samples])
    seen = Counter()
    for rank in range(2):
        ds = shards.dataset(rank=rank, world_size=2, even=False, seed=5)
        ds.set_epoch(1)
        batches = list(DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=_keys_and_labels))
        seen.update(key for b in batches for key in b["__key__"])
        distinct, _ = batch_mix([b["cls"] for b in batches])
        assert distinct >= 0.85 * iid_distinct, (rank, distinct, iid_distinct)
    assert len(seen) == len(samples) and set(seen.values()) == {1}


def _keys_and_labels(batch):
    return {"__key__": [s["__key__"] for s in batch], "cls": [s["cls"] for s in batch]}


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    window=st.integers(1, 8),
    interleave=st.integers(1, 5),
    block=st.integers(1, 7),
    cut=st.floats(0, 1),
    seed=st.integers(0, 5),
)
def test_the_schedule_reads_every_sample_once_and_resumes_from_counts(
    lengths, window, interleave, block, cut, seed
):
    """Every (piece, sample) once, each block front to back, no sample further than the window
    from its place; and after any prefix the counts alone give the rest of the order (what a
    resume does)."""
    pieces = [(s, 0, n) for s, n in enumerate(lengths)]
    schedule = mixing_schedule(
        pieces,
        block_starts=lambda s: np.arange(0, lengths[s], block),
        seed=(seed, 1),
        window=window,
        interleave=interleave,
    )
    order, nxt = [], schedule.starts.copy()
    for j in schedule.draws:
        order.append((int(schedule.shards[j]), int(nxt[j])))
        nxt[j] += 1
    assert (nxt == schedule.stops).all()
    assert Counter(order) == Counter((s, i) for s, n in enumerate(lengths) for i in range(n))
    place = {(s, i): sum(lengths[:s]) + i for s, n in enumerate(lengths) for i in range(n)}
    reach = window * sum(lengths) / len(lengths)
    assert all(
        abs(at - place[item]) <= reach + interleave * block + block for at, item in enumerate(order)
    )
    skip = int(cut * len(schedule))
    done = skip_counts(schedule, skip)
    resumed, nxt = [], schedule.starts + done
    for j in schedule.draws[skip:]:
        resumed.append((int(schedule.shards[j]), int(nxt[j])))
        nxt[j] += 1
    assert resumed == order[skip:]
    prefix = mixing_schedule(
        pieces,
        block_starts=lambda s: np.arange(0, lengths[s], block),
        seed=(seed, 1),
        window=window,
        interleave=interleave,
        draws_needed=skip,
    )  # an elastic resume's
    assert (prefix.draws == schedule.draws[: len(prefix.draws)]).all() and len(prefix.draws) >= skip
    assert (skip_counts(prefix, skip) == done).all()


def test_the_writer_shuffles_a_sequence_and_a_stream_and_keeps_every_sample():
    samples = [{"__key__": f"{i:04d}", "cls": i} for i in range(500)]
    permuted = [s["cls"] for s in shuffled_samples(samples, seed=1)]
    again = [s["cls"] for s in shuffled_samples(samples, seed=1)]
    streamed = [s["cls"] for s in shuffled_samples(iter(samples), seed=1, buffer_bytes=2_000)]
    for order in (permuted, streamed):
        assert sorted(order) == list(range(500)) and order != list(range(500))
    assert permuted == again
    # a bounded buffer (about 2,000 bytes: 26 of these samples) holds no more: no sample comes out
    # before the input has reached it, less the buffer's length
    assert max(s - pos for pos, s in enumerate(streamed)) <= 27


def test_write_shards_keeps_the_order_when_asked(tmp_path):
    samples = [{"__key__": f"{i:04d}", "cls": i} for i in range(60)]
    kept = write_shards(samples, tmp_path / "a", shuffle=False, progress=False)
    mixed = write_shards(samples, tmp_path / "b", progress=False)

    def read(s):
        return [x["cls"] for x in s.read(0)]

    assert read(kept) == list(range(60))
    assert read(mixed) != list(range(60)) and sorted(read(mixed)) == list(range(60))


def test_a_reader_that_gives_the_wrong_count_is_named(tmp_path):
    def read(path, start, stop):
        return iter(range(start, stop + 1))  # one too many

    ds = ShardedIterableDataset(
        ["a", "b"], read, shard_lengths=[5, 5], seed=0, rank=0, world_size=1, blocks=5
    )
    with pytest.raises(ValueError, match=r"gave 6 samples where the range holds 5"):
        list(ds)


def test_the_loader_state_refuses_another_window(tmp_path):
    samples = [{"__key__": f"{i:04d}", "cls": i} for i in range(90)]
    shards = write_shards(samples, tmp_path / "s", shard_bytes=2_000, progress=False)
    a, b = shards.dataset(shuffle_window=16), shards.dataset(shuffle_window=4)
    assert a.plan_settings() != b.plan_settings()
    assert ShardSet.open(tmp_path / "s").dataset().plan_settings() == a.plan_settings()


def test_a_second_pass_without_set_epoch_is_named():
    """Two passes at one epoch give the same order: said once, naming the fix (here a shuffled
    shard set and a bucketing sampler; a sampler without shuffling says nothing)."""
    import torch
    from torch.utils.data import TensorDataset

    from recipes.common import LengthBucketSampler, LoaderWarning

    def read(path, start, stop):
        return range(start, 10 if stop is None else stop)

    ds = ShardedIterableDataset(
        [str(i) for i in range(4)], read, shard_lengths=[10] * 4, rank=0, world_size=1
    )
    data = TensorDataset(torch.arange(40))
    bucketed = LengthBucketSampler(
        np.arange(40) % 7 + 1, batch_size=4, seed=1, num_replicas=1, rank=0
    )
    for loader in (
        make_loader(ds, batch_size=5, num_workers=0),
        make_loader(data, batch_sampler=bucketed, num_workers=0),
    ):
        first = [b for b in loader]
        with pytest.warns(LoaderWarning, match="set_epoch"):
            second = [b for b in loader]
        assert len(first) == len(second)
    plain = ShardedIterableDataset(
        [str(i) for i in range(4)],
        read,
        shard_lengths=[10] * 4,
        rank=0,
        world_size=1,
        shuffle=False,
    )
    loader = make_loader(plain, batch_size=5, num_workers=0)
    list(loader)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", LoaderWarning)
        list(loader)


def _ints(lengths):
    def read(path, start, stop):
        s = int(path.split("-")[1])
        return [s * 1000 + i for i in range(start, lengths[s] if stop is None else stop)]

    return read


def test_a_state_under_other_custom_blocks_is_refused():
    lengths = [10, 6, 8]

    def build(cuts):
        ds = ShardedIterableDataset(
            [f"shard-{i}" for i in range(3)],
            _ints(lengths),
            shard_lengths=lengths,
            blocks=lambda s: cuts,
            seed=1,
        )
        return make_loader(ds, batch_size=2, num_workers=0)

    a = build([0, 2])
    iterator = iter(a)
    next(iterator)
    state = json.loads(json.dumps(a.state_dict()))
    build([0, 2]).load_state_dict(state)  # the same cuts from another callable: accepted
    with pytest.raises(ValueError, match="mixing"):
        build([0, 5]).load_state_dict(state)


def test_a_ranged_reader_that_ignores_the_range_is_named_in_shard_order_too():
    lengths = [10, 6, 8]

    def read(path, start, stop):  # ignores start and stop
        s = int(path.split("-")[1])
        return [s * 1000 + i for i in range(lengths[s])]

    ds = ShardedIterableDataset(
        [f"shard-{i}" for i in range(3)],
        read,
        shard_lengths=lengths,
        split="samples",
        rank=0,
        world_size=2,
        even=False,
        shuffle_window=0,
    )
    with pytest.raises(ValueError, match="ignores `start`/`stop`"):
        list(ds)


def test_the_writers_buffer_counts_arrays_by_their_bytes():
    pulled = []

    def stream():
        for i in range(5_000):
            pulled.append(i)
            yield {
                "__key__": f"{i:05d}",
                "npy": np.zeros(2**16, np.float32),
                "cls": i,
            }  # 256 KiB each

    next(iter(shuffled_samples(stream(), buffer_bytes=8 * 2**20)))
    assert len(pulled) <= 33  # 8 MiB of 256 KiB arrays, not 8 bytes each
