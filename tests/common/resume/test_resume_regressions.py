"""Resume regressions an adversarial review found after the issue #19 repros (each failed
before its fix): stateful and position-keeping samplers, generators shared with the loader,
epoch boundaries (a finished epoch, a loop left early, set_epoch before the first batch),
sharded datasets near an epoch's end, settings a state is refused under, NumPy and OS random
sources, and two iterators of one persistent loader."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler

from recipes.common import LoaderWarning, make_loader
from recipes.testing import make_int_shards
from tests.common.resume.resume_checks import Ids, distributed, flat, repeated_and_lost, shuffled


class PositionSampler(DistributedSampler):
    """A set_epoch sampler whose state_dict() is its position in the pass (torchdata's
    StatefulDistributedSampler): the position must not be replayed on top of the loop's count."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.yielded, self.next_yielded = 0, None

    def __iter__(self):
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        for index in list(super().__iter__())[self.yielded :]:
            self.yielded += 1
            yield index

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self.next_yielded = state["yielded"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_position_keeping_stateful_sampler_resumes_by_its_epoch(workers):
    def build():
        return make_loader(
            Ids(36),
            batch_size=3,
            num_workers=workers,
            sampler=PositionSampler(Ids(36), num_replicas=2, rank=0, seed=1),
        )

    reference = build()
    reference.sampler.set_epoch(1)
    expected = flat(reference)
    first = build()
    list(first)
    first.sampler.set_epoch(1)
    iterator = iter(first)
    prefix = flat([next(iterator) for _ in range(2)])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    assert prefix + flat(resumed) == expected


def test_a_generator_shared_with_the_loader_keeps_the_order_at_an_epoch_boundary():
    def build():
        g = torch.Generator().manual_seed(4)
        return make_loader(
            Ids(12),
            batch_size=4,
            sampler=RandomSampler(Ids(12), generator=g),
            generator=g,
            num_workers=0,
        )

    reference = build()
    epochs = [flat(reference) for _ in range(2)]
    first = build()
    list(first)
    resumed = build()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert flat(resumed) == epochs[1]


def test_sharded_without_lengths_resumes_exactly_near_the_end_of_an_epoch(tmp_path):
    from recipes.common import ShardedIterableDataset

    paths = make_int_shards(tmp_path, [9, 14, 6, 11, 8, 12])

    def build():
        ds = ShardedIterableDataset(
            paths, read_ints, seed=2, rank=0, world_size=1
        )  # no shard_lengths
        ds.set_epoch(2)
        return make_loader(ds, batch_size=4, num_workers=3, persistent_workers=True)

    expected = flat(build())
    first = build()
    iterator = iter(first)
    prefix = flat(
        [next(iterator) for _ in range(14)]
    )  # two of the three workers have run out by now
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    resumed = build()
    resumed.load_state_dict(state)
    got = prefix + flat(resumed)
    assert repeated_and_lost(got, 60) == (0, 0) and got == expected


def read_ints(path, start=0, stop=None):
    return [int(x) for x in Path(path).read_text().split()][start:stop]


def test_a_state_after_an_epoch_names_the_finished_epoch():
    loader = distributed()
    loader.sampler.set_epoch(2)
    list(loader)
    ended = loader.state_dict()
    loader.sampler.set_epoch(3)
    assert (ended["epoch"], ended["finished_epoch"]) == (2, 2)
    assert loader.state_dict()["epoch"] == 3


def test_breaking_out_of_an_epoch_pauses_it():
    """Issue #28: a loop that breaks at a step limit, then checkpoints, resumes at the first
    batch it did not receive (torchdata's behaviour); only exhausting the epoch ends it. The
    same loader iterated again after the break starts the next epoch, as DataLoader does."""

    def two_steps(loader):
        got = []
        for step, batch in enumerate(loader):
            got.append(batch.tolist())
            if step == 1:
                break
        return got

    reference = shuffled()
    epochs = [flat(reference), flat(reference)]
    first = shuffled()
    head = two_steps(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["epoch"], state["batches_yielded"]) == (0, 2)
    resumed = shuffled()
    resumed.load_state_dict(state)
    rest = flat(resumed)
    assert [i for b in head for i in b] + rest == epochs[0]  # the rest of epoch 0, then
    assert flat(resumed) == epochs[1]  # epoch 1, as uninterrupted
    again = flat(first)  # the same loader after its break: the next epoch, whole
    assert sorted(again) == sorted(epochs[0]) and first.state_dict()["finished_epoch"] == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_between_iter_and_the_first_batch(workers):
    def build():
        sampler = DistributedSampler(Ids(24), num_replicas=1, rank=0, seed=3)
        return make_loader(Ids(24), batch_size=3, sampler=sampler, num_workers=workers)

    first = build()
    iterator = iter(first)
    first.sampler.set_epoch(
        1
    )  # with workers the order is already drawn (epoch 0); without, not yet
    prefix = flat([next(iterator) for _ in range(2)])
    state = json.loads(json.dumps(first.state_dict()))
    rest = flat(iterator)
    resumed = build()
    resumed.load_state_dict(state)
    assert flat(resumed) == rest and repeated_and_lost(prefix + rest, 24) == (0, 0)


def _subset(ids):
    return torch.utils.data.SubsetRandomSampler(ids, generator=torch.Generator().manual_seed(0))


def _weighted(weights):
    return torch.utils.data.WeightedRandomSampler(
        weights, 20, generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize(
    "saved, other, name",
    [
        (_subset(list(range(10))), _subset(list(range(10, 20))), "indices"),  # another train split
        (_weighted([1.0] * 20), _weighted([1.0] * 10 + [0.0] * 10), "weights"),
    ],
)
def test_other_subset_indices_or_weights_are_refused(saved, other, name):
    first = make_loader(Ids(20), batch_size=4, num_workers=0, sampler=saved)
    second = make_loader(Ids(20), batch_size=4, num_workers=0, sampler=other)
    with pytest.raises(ValueError, match=f"sampler.{name}"):
        second.load_state_dict(first.state_dict())


class PartlyGlobal(Sampler):
    """Holds a generator, but draws its order from NumPy's global one."""

    def __init__(self, n):
        self.n, self.generator = n, torch.Generator().manual_seed(0)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(np.random.permutation(self.n).tolist())


def test_a_sampler_with_a_generator_that_draws_from_the_global_one_is_named():
    loader = make_loader(Ids(), batch_size=4, sampler=PartlyGlobal(48), num_workers=0)
    with pytest.warns(LoaderWarning, match="PartlyGlobal drew its order from NumPy's global"):
        next(iter(loader))


@pytest.mark.parametrize("bits", ["MT19937", "Philox", "SFC64", "PCG64"])
def test_numpy_bit_generator_states_are_json(bits):
    def build(seed):
        return make_loader(
            Ids(),
            batch_size=4,
            sampler=NumpyPerm(48, getattr(np.random, bits)(seed)),
            num_workers=0,
        )

    reference = build(1)
    list(reference)
    expected = flat(reference)
    first = build(1)
    list(first)
    iterator = iter(first)
    prefix = flat([next(iterator) for _ in range(3)])
    resumed = build(7)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert prefix + flat(resumed) == expected


class NumpyPerm(Sampler):
    def __init__(self, n, bit_generator):
        self.n, self.rng = n, np.random.Generator(bit_generator)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())


class OsEntropy(Sampler):
    def __init__(self, n):
        import random

        self.n, self.rng = n, random.SystemRandom()

    def __len__(self):
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)


def test_a_system_random_sampler_iterates_and_is_named_as_unreproducible():
    loader = make_loader(Ids(), batch_size=4, sampler=OsEntropy(48), num_workers=0)
    assert sorted(flat(loader)) == list(range(48))
    with pytest.warns(
        LoaderWarning, match="SystemRandom draws from the operating system's entropy"
    ):
        loader.state_dict()


def test_two_iterators_of_a_persistent_loader_count_on_the_pass_they_read():
    loader = make_loader(
        Ids(22), batch_size=4, num_workers=2, persistent_workers=True, shuffle=True
    )
    older, newer = iter(loader), iter(loader)  # the second resets the workers' shared iterator
    prefix = flat([next(older), next(older), next(newer)])
    state = json.loads(json.dumps(loader.state_dict()))
    rest = flat(newer)
    assert state["batches_yielded"] == 3
    resumed = make_loader(
        Ids(22), batch_size=4, num_workers=2, persistent_workers=True, shuffle=True
    )
    resumed.load_state_dict(state)
    assert flat(resumed) == rest and repeated_and_lost(prefix + rest, 22) == (0, 0)
