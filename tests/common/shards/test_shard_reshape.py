"""Shards resumed on another shape (issue #38, `shard_reshape.py`) and the node-affine plan
(`shard_plan.py`): an epoch interrupted on R ranks x K workers and finished on R' x K' (any R',
growing or shrinking, not only dividing R; mixed or in shard order; several times in one epoch)
reads every sample once over all the runs, counted, the only repeats the padding of each deal
to equal steps (at most R - 1 each), with equal steps on the new ranks, and the rest read by the
new ranks' workers (no replay in the main process). Node-affine, each node reads the same shards
every epoch and every sample once per epoch over the nodes. `HYPOTHESIS_PROFILE=thorough` draws
300 sequences of shapes (10 in the default suite)."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes.common import PrefetchCache, ShardedIterableDataset, StatefulLoader
from recipes.testing import make_int_shards


def _reader(path, start, stop):
    return [int(x) for x in Path(path).read_text().split()][start:stop]


def _dataset(paths, sizes, rank, world, *, window=16, cache=None):
    return ShardedIterableDataset(
        paths,
        _reader,
        shard_lengths=sizes,
        rank=rank,
        world_size=world,
        split="samples",
        seed=5,
        shuffle_window=window,
        cache=cache,
    )


def _epoch_over_shapes(paths, sizes, shapes, *, batch, window=16, cache_for=None):
    """Epoch 0 over `shapes` (ranks, workers, steps; None: to the end), each later shape loading
    rank 0's state as JSON. Returns the count of every sample and the steps of the last ranks."""
    counts, state = collections.Counter(), None
    for world, workers, steps in shapes:
        loaders = []
        for rank in range(world):
            cache = None if cache_for is None else cache_for(rank, world)
            loader = StatefulLoader(
                _dataset(paths, sizes, rank, world, window=window, cache=cache),
                batch_size=batch,
                num_workers=workers,
            )
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            loaders.append(loader)
        iterators = [iter(loader) for loader in loaders]
        if steps is None:
            lengths = []
            for iterator in iterators:
                got = [b.tolist() for b in iterator]
                lengths.append(len(got))
                counts.update(i for b in got for i in b)
            return counts, lengths
        for _ in range(steps):
            for iterator in iterators:
                counts.update(next(iterator).tolist())
        state = loaders[0].state_dict()
        del iterators


@st.composite
def _plans(draw):
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=7).filter(lambda s: sum(s) >= 8))
    batch = draw(st.integers(1, 4))
    shapes, ranks, left = [], draw(st.integers(1, 4)), sum(sizes)
    for _ in range(draw(st.integers(1, 3))):
        safe = left // (ranks * batch) - 1  # steps every rank surely has, whatever its workers
        if safe < 0:
            break
        steps = draw(st.integers(0, min(2, safe)))
        shapes.append((ranks, draw(st.integers(0, 1)), steps))
        left -= steps * ranks * batch
        ranks = draw(st.integers(1, 4))
    shapes.append((ranks, draw(st.integers(0, 2)), None))
    return sizes, batch, shapes, draw(st.sampled_from([0, 16]))


@settings(
    max_examples=300 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 10, deadline=None
)
@given(plan=_plans())
def test_any_change_of_shape_reads_every_sample_once(tmp_path_factory, plan):
    sizes, batch, shapes, window = plan
    paths = make_int_shards(tmp_path_factory.mktemp("ints"), sizes)
    counts, lengths = _epoch_over_shapes(paths, sizes, shapes, batch=batch, window=window)
    assert set(counts) == set(range(sum(sizes)))  # nothing lost
    assert sum(counts.values()) - sum(sizes) <= sum(
        w - 1 for w, _, _ in shapes
    )  # a deal pads at most R - 1
    assert len(set(lengths)) == 1  # the new ranks step together


def test_four_ranks_stopped_mid_epoch_finish_on_three_with_two_workers_each(tmp_path):
    sizes = [37, 50, 23, 64, 11, 40, 30, 30, 25, 19]
    paths = make_int_shards(tmp_path, sizes)
    counts, lengths = _epoch_over_shapes(paths, sizes, [(4, 2, 6), (3, 2, None)], batch=4)
    total = sum(sizes)
    assert sorted(counts) == list(range(total)) and sum(counts.values()) - total <= 3 + 2
    assert len(set(lengths)) == 1


@pytest.mark.parametrize("then", [(1, 0), (3, 2)])
def test_a_state_saved_after_the_epochs_last_batch_resumes_on_another_shape_to_nothing(
    tmp_path, then
):
    """Every batch received, the epoch not yet ended (a checkpoint right after the last step):
    the rest on another shape is empty, not an IndexError in `rest_fragments`."""
    sizes = [10, 6]
    paths = make_int_shards(tmp_path, sizes)
    shapes = [(2, 1, 2), (*then, None)]  # 2 ranks x 8 samples = 2 batches of 4 each
    counts, lengths = _epoch_over_shapes(paths, sizes, shapes, batch=4)
    assert sorted(counts) == list(range(16)) and sum(counts.values()) == 16
    assert set(lengths) == {0}


def test_the_rest_is_read_by_the_new_workers_not_replayed_in_the_main_process(tmp_path):
    """The resumed epoch's samples come from the loader's worker processes (each sample's
    reader runs in a worker), where the replay of old ranks' rests read them in this one."""
    sizes = [20] * 6
    paths = make_int_shards(tmp_path, sizes)
    main, seen = os.getpid(), []

    def reader(path, start, stop):
        return [(int(x), os.getpid()) for x in Path(path).read_text().split()][start:stop]

    def build(rank, world):
        return ShardedIterableDataset(
            paths, reader, shard_lengths=sizes, rank=rank, world_size=world, split="samples"
        )

    first = StatefulLoader(build(0, 2), batch_size=4, num_workers=0, collate_fn=list)
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()
    resumed = StatefulLoader(build(0, 3), batch_size=4, num_workers=2, collate_fn=list)
    resumed.load_state_dict(state)
    seen = [pid for batch in resumed for _, pid in batch]
    assert seen and main not in seen and len(set(seen)) == 2


def test_another_node_count_on_as_many_ranks_is_a_new_shape(tmp_path, monkeypatch):
    """4 ranks as 2 nodes (node-affine with a cache) resumed as 4 ranks on 1 node: the plan
    differs, so the rest is dealt anew (the same-shape arithmetic would repeat and lose)."""
    sizes = [25] * 8
    paths = make_int_shards(tmp_path / "ints", sizes)
    counts = collections.Counter()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loaders = [
        StatefulLoader(
            _dataset(
                paths, sizes, r, 4, cache=PrefetchCache(tmp_path / f"c{r // 2}", max_bytes=10**7)
            ),
            batch_size=5,
            num_workers=0,
        )
        for r in range(4)
    ]
    assert loaders[0].dataset.nodes == 2
    iterators = [iter(loader) for loader in loaders]
    for _ in range(3):
        for iterator in iterators:
            counts.update(next(iterator).tolist())
    state = loaders[0].state_dict()
    assert state["nodes"] == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for r in range(4):
        loader = StatefulLoader(
            _dataset(paths, sizes, r, 4, cache=PrefetchCache(tmp_path / "c0", max_bytes=10**7)),
            batch_size=5,
            num_workers=0,
        )
        assert loader.dataset.nodes == 1
        loader.load_state_dict(state)
        counts.update(i for b in loader for i in b.tolist())
    assert sorted(counts) == list(range(200)) and sum(counts.values()) == 200


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (3, 1), (2, 3)])
def test_node_affine_nodes_keep_their_shards_and_read_every_sample_once(
    tmp_path, monkeypatch, nodes, per_node
):
    sizes = [37, 50, 23, 64, 11, 40, 30, 30, 25, 19]
    paths = make_int_shards(tmp_path / "ints", sizes)
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    world = nodes * per_node
    held = collections.defaultdict(set)
    for epoch in range(3):
        counts, steps = collections.Counter(), []
        for rank in range(world):
            ds = _dataset(
                paths,
                sizes,
                rank,
                world,
                cache=PrefetchCache(tmp_path / f"c{rank // per_node}", max_bytes=10**7),
            )
            assert ds.nodes == nodes
            ds.set_epoch(epoch)
            got = [b.tolist() for b in StatefulLoader(ds, batch_size=4, num_workers=0)]
            steps.append(len(got))
            mine = [i for b in got for i in b]
            counts.update(mine)
            held[epoch, rank // per_node] |= set(mine)
        assert (
            sorted(counts) == list(range(sum(sizes)))
            and sum(counts.values()) - sum(sizes) <= world - 1
        )
        assert len(set(steps)) == 1
    for node in range(nodes):  # the same samples on each node every epoch
        assert held[0, node] == held[1, node] == held[2, node]
    shards = [set(shard_of[sorted(held[0, n])].tolist()) for n in range(nodes)]
    shared = sum(len(a & b) for k, a in enumerate(shards) for b in shards[k + 1 :])
    assert shared <= nodes - 1  # only the shards on the boundaries between nodes are read by two


@pytest.mark.parametrize("window", [0, 16])
def test_a_rest_given_by_each_consumers_own_count_is_read_once_over_a_new_shape(tmp_path, window):
    """`resume_consumed`: the samples each consumer of 2 ranks x 2 workers received (its own
    count, not a loader's batches), then the rest over 3 ranks x 1 worker and again over
    1 x 2: every sample once, the only repeats each deal's padding."""
    from recipes.common.shards.epochs.epoch_resume import ConsumedShape

    sizes = [37, 50, 23, 64, 11, 40]
    paths = make_int_shards(tmp_path, sizes)
    base = _dataset(paths, sizes, 0, 1, window=window)
    counts = collections.Counter()
    shapes = []
    for ranks, workers, take in [(2, 2, [[5, 9], [0, 13]]), (3, 1, [[7], [2], [11]])]:
        rest = base.resume_consumed(shapes)
        for r in range(ranks):
            lengths = rest.consumer_lengths(r, ranks, workers=workers)
            assert lengths.shape == (workers,)
            for w in range(workers):
                got = list(rest.consumer_samples(r, ranks, worker=w, workers=workers))
                assert len(got) == lengths[w]
                counts.update(got[: take[r][w]])
                assert (
                    list(rest.consumer_samples(r, ranks, worker=w, workers=workers, skip=3))
                    == got[3:]
                )
        shapes.append(ConsumedShape(ranks, workers, take))
    last = base.resume_consumed(shapes)
    for w in range(2):
        counts.update(last.consumer_samples(0, 1, worker=w, workers=2))
    total = sum(sizes)
    assert sorted(counts) == list(range(total))
    assert sum(counts.values()) - total <= 1 + 2  # each deal pads at most ranks - 1
