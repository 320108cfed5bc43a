import collections
import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from recipes.common import ShardedIterableDataset, shard_indices


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 120), world=st.integers(1, 5), workers=st.integers(1, 4))
def test_exactly_once_without_even(n, world, workers):
    parts = [
        shard_indices(n, rank=r, world_size=world, worker=w, num_workers=workers, even=False)
        for r in range(world)
        for w in range(workers)
    ]
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    per_rank = [sum(len(parts[r * workers + w]) for w in range(workers)) for r in range(world)]
    assert max(per_rank) - min(per_rank) <= 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 120), world=st.integers(1, 5), workers=st.integers(1, 4))
def test_even_gives_equal_ranks_with_few_documented_repeats(n, world, workers):
    per_rank = []
    everything = []
    for r in range(world):
        rank_parts = [
            shard_indices(n, rank=r, world_size=world, worker=w, num_workers=workers, even=True)
            for w in range(workers)
        ]
        sizes = [len(p) for p in rank_parts]
        assert max(sizes) - min(sizes) <= 1  # workers of a rank differ by at most one
        per_rank.append(sum(sizes))
        everything += np.concatenate(rank_parts).tolist()
    assert len(set(per_rank)) == 1 and per_rank[0] == -(-n // world)
    assert set(everything) == set(range(n))  # every index, including n < consumers
    repeats = len(everything) - n
    assert repeats <= world - 1
    extras = Counter(everything) - Counter(range(n))
    assert extras == Counter(
        i % n for i in range(repeats)
    )  # the repeats are the first indices, in order


def test_invalid_arguments():
    with pytest.raises(ValueError, match="`world_size` must be positive"):
        shard_indices(5, rank=0, world_size=0, worker=0, num_workers=1)
    with pytest.raises(ValueError, match="outside world_size=2"):
        shard_indices(5, rank=2, world_size=2, worker=0, num_workers=1)


def _write_shards(folder, lengths):
    """Shards of text lines: shard s holds samples s*1000 + i."""
    paths = []
    for s, n in enumerate(lengths):
        path = folder / f"shard-{s:03d}.txt"
        path.write_text("".join(f"{s * 1000 + i}\n" for i in range(n)))
        paths.append(str(path))
    return paths


def read_lines(path):
    with open(path) as f:
        for line in f:
            yield int(line)


class RangeReader:
    """A reader that takes ranges and records what it read."""

    def __init__(self):
        self.read = []

    def __call__(self, path, start, stop):
        for i, value in enumerate(read_lines(path)):
            if stop is not None and i >= stop:
                return
            if i >= start:
                yield value


def _collect(paths, lengths, *, world, workers, even, reader=read_lines, epoch=0, seed=0):
    out = []
    for rank in range(world):
        ds = ShardedIterableDataset(
            paths, reader, shard_lengths=lengths, seed=seed, even=even, rank=rank, world_size=world
        )
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        out.append([int(x) for x in loader])
    return out


def ALL(lengths):
    return sorted(s * 1000 + i for s, n in enumerate(lengths) for i in range(n))


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("lengths", [[5, 7, 3, 9, 4, 6, 8, 2], [40, 13], [11]])
def test_dataloader_exactly_once_over_ranks_and_workers(tmp_path, workers, world, lengths):
    paths = _write_shards(tmp_path, lengths)
    ranks = _collect(paths, lengths, world=world, workers=workers, even=False)
    assert sorted(itertools.chain.from_iterable(ranks)) == ALL(lengths)


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("lengths", [[5, 7, 3, 9, 4, 6, 8, 2], [40, 13], [11]])
def test_even_ranks_yield_the_same_count(tmp_path, workers, lengths):
    paths = _write_shards(tmp_path, lengths)
    ranks = _collect(paths, lengths, world=3, workers=workers, even=True, reader=RangeReader())
    assert len({len(r) for r in ranks}) == 1  # DDP-safe
    seen = list(itertools.chain.from_iterable(ranks))
    consumers = 3 * max(workers, 1)
    if len(lengths) < consumers:  # sample ranges: everything, at most world-1 repeats
        assert set(seen) == set(ALL(lengths)) and len(seen) - len(ALL(lengths)) <= 2
    else:  # whole shards: no repeats, ranks cut to the smallest rank's count
        assert len(seen) == len(set(seen)) and set(seen) <= set(ALL(lengths))


def test_ranges_are_read_without_reading_discarded_samples(tmp_path):
    lengths = [30, 30]
    paths = _write_shards(tmp_path, lengths)
    calls = []

    def reader(path, start, stop):
        calls.append((path.rsplit("/", 1)[1], start, stop))
        yield from itertools.islice(read_lines(path), start, stop)

    ranks = _collect(
        paths, lengths, world=4, workers=0, even=True, reader=reader
    )  # reads in this process
    assert sorted(itertools.chain.from_iterable(ranks)) == ALL(lengths)
    # every sample read once, by its range, nothing read past (shard order: one range of 15 per
    # consumer; mixed: single samples)
    read = collections.Counter((name, i) for name, start, stop in calls for i in range(start, stop))
    assert len(read) == 60 and set(read.values()) == {1}


def test_shuffle_is_per_epoch_and_seeded(tmp_path):
    lengths = [3] * 12
    paths = _write_shards(tmp_path, lengths)
    e0 = _collect(paths, lengths, world=1, workers=0, even=False, epoch=0)[0]
    again = _collect(paths, lengths, world=1, workers=0, even=False, epoch=0)[0]
    e1 = _collect(paths, lengths, world=1, workers=0, even=False, epoch=1)[0]
    assert e0 == again and e0 != e1 and sorted(e0) == sorted(e1)


def test_set_epoch_reaches_persistent_workers(tmp_path):
    lengths = [4] * 10
    paths = _write_shards(tmp_path, lengths)
    ds = ShardedIterableDataset(paths, read_lines, shard_lengths=lengths, seed=3)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        epochs.append([int(x) for x in loader])
    expected = [
        _collect(paths, lengths, world=1, workers=2, even=True, epoch=e, seed=3)[0]
        for e in range(3)
    ]
    assert epochs == expected and epochs[0] != epochs[1]


def test_even_under_ddp_needs_lengths(tmp_path):
    paths = _write_shards(tmp_path, [3, 3])
    with pytest.raises(ValueError, match="needs `shard_lengths`"):
        ShardedIterableDataset(paths, read_lines, rank=0, world_size=2)
    ShardedIterableDataset(paths, read_lines, rank=0, world_size=2, even=False)


def test_pickles(tmp_path):
    import pickle

    paths = _write_shards(tmp_path, [2, 2])
    ds = pickle.loads(pickle.dumps(ShardedIterableDataset(paths, read_lines, shard_lengths=[2, 2])))
    assert sorted(int(x) for x in ds) == ALL([2, 2])
