"""Resume loses nothing by default (issue #10): save after k batches, resume in a fresh loader,
and prefix + rest equals the uninterrupted epoch."""

import json

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from recipes.common import LengthBucketSampler, LoaderWarning, ShardedIterableDataset, make_loader
from recipes.common.loading.stateful_loader import StatefulLoader
from recipes.testing import make_int_shards

# (workers, prefetch_factor); prefetch 1 and 4 are in the slow tier (the state machine of
# test_exactly_once.py draws them in the fast tier too)
CONFIGS = [
    (0, None),
    pytest.param(2, 1, marks=pytest.mark.slow),
    (2, 2),
    pytest.param(2, 4, marks=pytest.mark.slow),
]


class Ids(Dataset):
    def __init__(self, n=97):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def read_ints(path):
    return [int(x) for x in path.read_text().split()]


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    sizes = [13, 7, 21, 9, 16, 11]
    return make_int_shards(tmp_path_factory.mktemp("shards"), sizes), sizes


def _build(kind, workers, prefetch, shard_files, seed=0):
    extra = {} if prefetch is None else {"prefetch_factor": prefetch}
    common = dict(num_workers=workers, persistent_workers=False, **extra)
    if kind == "shuffle":
        torch.manual_seed(
            seed
        )  # a resumed process need not seed alike: the state carries the order
        return make_loader(Ids(), batch_size=4, shuffle=True, **common)
    if kind == "bucket":
        lengths = np.random.default_rng(0).integers(5, 60, 97)
        sampler = LengthBucketSampler(lengths, max_tokens=200, seed=4)
        sampler.set_epoch(1)
        return make_loader(Ids(), batch_sampler=sampler, **common)
    if kind == "distributed":
        sampler = DistributedSampler(Ids(), num_replicas=2, rank=1, shuffle=True, seed=3)
        sampler.set_epoch(2)
        return make_loader(Ids(), batch_size=5, sampler=sampler, **common)
    paths, sizes = shard_files
    ds = ShardedIterableDataset(
        paths,
        lambda p: read_ints(__import__("pathlib").Path(p)),
        shard_lengths=sizes,
        seed=1,
        rank=0,
        world_size=1,
    )
    ds.set_epoch(1)
    return make_loader(ds, batch_size=3, **common)


def _ids(batch):
    return batch.flatten().tolist()


@pytest.mark.parametrize("workers, prefetch", CONFIGS)
@pytest.mark.parametrize("kind", ["shuffle", "bucket", "distributed", "sharded"])
def test_prefix_plus_resumed_rest_is_the_uninterrupted_epoch(kind, workers, prefetch, shard_files):
    full = [_ids(b) for b in _build(kind, workers, prefetch, shard_files)]
    assert len(full) > 6
    for k in (0, 1, 5, len(full) - 1, len(full)):
        first = _build(kind, workers, prefetch, shard_files)
        iterator = iter(first)
        prefix = [_ids(next(iterator)) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))  # plain JSON
        assert state["batches_yielded"] == k
        del iterator, first
        second = _build(kind, workers, prefetch, shard_files, seed=123)
        second.load_state_dict(state)
        rest = [_ids(b) for b in second]
        assert prefix + rest == full, (kind, k)
        # and the epoch after the resumed one is whole again
        if kind == "sharded":
            second.dataset.set_epoch(2)
        assert sum(len(b) for b in map(_ids, second)) == sum(len(b) for b in full)


def test_the_issue_repro_loses_no_batch():
    lengths = np.random.default_rng(0).integers(8, 120, 2000)

    def build():
        return make_loader(
            Ids(2000),
            num_workers=2,
            prefetch_factor=2,
            batch_sampler=LengthBucketSampler(lengths, max_tokens=2048, seed=0),
        )

    loader = build()
    total = len(loader)
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    with pytest.warns(LoaderWarning, match="ahead of training"):
        loader.batch_sampler.state_dict()  # the sampler's own count: warned, not silent
    state = loader.state_dict()
    del iterator
    resumed = build()
    resumed.load_state_dict(state)
    assert len(list(resumed)) == total - 5


def test_a_foreign_state_is_refused():
    loader = make_loader(Ids(), batch_size=4, num_workers=0)
    assert isinstance(loader, StatefulLoader)
    with pytest.raises(ValueError, match="not a StatefulLoader state"):
        loader.load_state_dict({"epoch": 3})


class _Unsized(Dataset):
    """No `__len__`: the loader's plan (which holds the dataset's length) cannot be computed."""

    def __getitem__(self, index):
        return index


def test_a_state_of_another_version_gets_the_version_error_before_the_plan_is_computed():
    # the version is checked first (as in 137c7d1): not the plan's own error
    loader = StatefulLoader(_Unsized(), batch_size=2, sampler=list(range(6)))
    with pytest.raises(ValueError, match="not a StatefulLoader state"):
        loader.load_state_dict({"version": 99, "batches_yielded": 1})


@pytest.mark.parametrize("kind", ["shuffle", "sharded"])
@pytest.mark.parametrize("before, after", [(2, 0), (2, 1), (0, 2), (3, 2)])
def test_resume_with_another_worker_count(kind, before, after, shard_files):
    """As after a RobustLoader step down: the order of the interrupted epoch is kept."""
    full = [_ids(b) for b in _build(kind, before, None if before == 0 else 2, shard_files)]
    first = _build(kind, before, None if before == 0 else 2, shard_files)
    iterator = iter(first)
    prefix = [_ids(next(iterator)) for _ in range(4)]
    state = first.state_dict()
    del iterator, first
    second = _build(kind, after, None if after == 0 else 2, shard_files, seed=9)
    second.load_state_dict(state)
    assert prefix + [_ids(b) for b in second] == full
