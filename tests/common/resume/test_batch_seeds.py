"""Per-batch seeds (`common/resume/batch_seeds.py`, issue #28 review): a dataset's own random draws
follow the batch's position in the epoch, also under a positioned batch sampler resumed
mid-epoch, and for batch samplers that yield tuples or NumPy integers; what cannot carry a
seed is named by a warning."""

import json
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Sampler

from recipes.common import LengthBucketSampler, LoaderWarning, StatefulLoader


class Draws(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return int(i), torch.rand(()).item(), float(np.random.rand())


def _resumed(build, cut: int):
    """(uninterrupted batches, the first run's `cut` batches + a fresh loader's rest)."""
    torch.manual_seed(0)
    whole = list(build())
    torch.manual_seed(0)
    first, head = build(), []
    for batch in first:
        head.append(batch)
        if len(head) == cut:
            break
    state = json.loads(json.dumps(first.state_dict()))
    torch.manual_seed(99)  # the resumed process's own seed does not matter
    second = build()
    second.load_state_dict(state)
    return whole, head + list(second)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_positioned_batch_sampler_resumed_mid_epoch_draws_what_the_uninterrupted_run_drew(
    workers,
):
    """A `LengthBucketSampler` resumes by itself (its state), and its resumed batches were
    seeded as positions 0, 1, ... again."""

    def build():
        sampler = LengthBucketSampler(
            np.arange(24) % 7 + 1, batch_size=3, seed=2, num_replicas=1, rank=0
        )
        return StatefulLoader(
            Draws(),
            batch_sampler=sampler,
            collate_fn=list,
            num_workers=workers,
            generator=torch.Generator().manual_seed(1),
        )

    whole, resumed = _resumed(build, 3)
    assert resumed == whole


class Pairs(Sampler):
    """A batch sampler yielding tuples (as `zip` or `itertools.batched` make them)."""

    def __len__(self):
        return 12

    def __iter__(self):
        return iter([(i, i + 1) for i in range(0, 24, 2)])


class NumpyIndices(Sampler):
    def __len__(self):
        return 24

    def __iter__(self):
        return iter(np.random.default_rng(3).permutation(24))


@pytest.mark.parametrize("kind", ["tuples", "numpy_ints"])
def test_tuple_batches_and_numpy_indices_carry_their_seed(kind):
    def build():
        if kind == "tuples":
            return StatefulLoader(Draws(), batch_sampler=Pairs(), collate_fn=list)
        return StatefulLoader(
            Draws(), sampler=NumpyIndices(), batch_size=None, collate_fn=lambda x: x
        )

    whole, resumed = _resumed(build, 5)
    assert resumed == whole


class ArrayBatches(Sampler):
    def __len__(self):
        return 6

    def __iter__(self):
        return iter(np.arange(24).reshape(6, 4))


def test_batches_that_cannot_carry_a_seed_are_named():
    loader = StatefulLoader(Draws(), batch_sampler=ArrayBatches(), collate_fn=list)
    with pytest.warns(LoaderWarning, match="yields ndarray batches.*will not be reproduced"):
        assert len(list(loader)) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader)  # once per loader
