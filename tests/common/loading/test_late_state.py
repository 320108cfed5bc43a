"""A state loaded after `iter(loader)` and before that iterator handed a batch over applies to
it (issue 31): Lightning can call `iter()` before it restores a checkpoint (#20550), and
Lightning's pending fix for it (#21770) loads the state after an `iter()`. Each case: an
uninterrupted run's first epoch, its second epoch up to a save, then a new loader (another
seed, so a state not applied shows) iterated first and loaded second: its batches, counted,
are the rest of the uninterrupted run, in order. Once a batch was handed over, a loaded state
waits for the next `iter()`, as before."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from recipes.common import RobustLoader, ThreadLoader, make_loader
from tests.common.resume.resume_checks import Ids, flat, repeated_and_lost

EPOCH = 12  # batches of 4 in an epoch of 48


class ThreadIds(Ids):
    def thread_batches(self):
        return True


LOADERS = {
    "persistent workers": lambda: make_loader(Ids(), batch_size=4, shuffle=True, num_workers=2),
    "workers, not persistent": lambda: make_loader(
        Ids(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=False
    ),  # (slow tier: 1 s)
    "no workers": lambda: make_loader(Ids(), batch_size=4, shuffle=True, num_workers=0),
    "threads": lambda: make_loader(
        ThreadIds(), batch_size=4, shuffle=True, path="threads", threads=2
    ),
    "RobustLoader": lambda: RobustLoader(Ids(), batch_size=4, shuffle=True, num_workers=2),
}


def _saved_in_epoch_1(build, at: int = 5):
    """(the uninterrupted run's two epochs, a state saved after `at` batches of the second)."""
    torch.manual_seed(0)
    whole = build()
    epochs = [flat(whole), flat(whole)]
    torch.manual_seed(0)
    run = build()
    flat(run)
    iterator = iter(run)
    for _ in range(at):
        next(iterator)
    return epochs, run.state_dict()


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if "not persistent" in n else n for n in LOADERS],
)
def test_a_state_loaded_after_iter_applies_to_that_iterator(name):
    epochs, state = _saved_in_epoch_1(LOADERS[name])
    torch.manual_seed(1)  # another order, were the state not applied
    loader = LOADERS[name]()
    iterator = iter(loader)
    loader.load_state_dict(state)
    rest = flat(iterator)
    assert rest == epochs[1][5 * 4 :]
    assert repeated_and_lost(epochs[1][: 5 * 4] + rest, 48) == (0, 0)
    if isinstance(loader, ThreadLoader):
        assert len(rest) == (EPOCH - 5) * 4


def test_a_late_state_with_a_set_epoch_sampler_resumes_its_epoch():
    """Lightning sets a DistributedSampler's epoch around its `iter()`: iterated at epoch 0, then
    a state of epoch 1 loaded, the iterator gives epoch 1's rest, and epoch 2 follows."""

    def build():
        sampler = DistributedSampler(Ids(), num_replicas=2, rank=0, shuffle=True, seed=0)
        return make_loader(Ids(), batch_size=2, sampler=sampler, num_workers=0)

    whole = build()
    epochs = []
    for epoch in range(3):
        whole.sampler.set_epoch(epoch)
        epochs.append(flat(whole))
    run = build()
    run.sampler.set_epoch(1)
    iterator = iter(run)
    taken = [next(iterator) for _ in range(3)]
    state = run.state_dict()
    resumed = build()
    iterator = iter(resumed)  # epoch 0: the sampler's own
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # as Lightning does before each epoch
    assert flat(taken) + flat(iterator) == epochs[1]
    resumed.sampler.set_epoch(2)
    assert flat(resumed) == epochs[2]


def test_once_a_batch_was_handed_over_a_loaded_state_waits_for_the_next_iter():
    epochs, state = _saved_in_epoch_1(LOADERS["no workers"])
    torch.manual_seed(0)
    loader = LOADERS["no workers"]()
    iterator = iter(loader)
    first = [next(iterator)]
    loader.load_state_dict(state)
    assert flat(first) + flat(iterator) == epochs[0]  # this epoch goes on as it began
    assert flat(loader) == epochs[1][5 * 4 :]  # the next iter() is the loaded state's


def test_set_epoch_after_iter_and_before_the_first_batch_starts_that_epoch_with_workers():
    """As without workers (the order is drawn lazily there). Lightning resumed after an epoch's
    last step: the state (epoch 0, nothing left) loaded, `iter()`, then `set_epoch(1)`: epoch 1."""

    def build():
        sampler = DistributedSampler(Ids(), num_replicas=2, rank=0, shuffle=True, seed=0)
        return make_loader(Ids(), batch_size=2, sampler=sampler, num_workers=2)

    whole = build()
    epochs = []
    for epoch in range(2):
        whole.sampler.set_epoch(epoch)
        epochs.append(flat(whole))
    ended = whole.state_dict()  # after epoch 1's loop: set_epoch(2) not called yet
    whole.sampler.set_epoch(0)
    iterator = iter(whole)
    next(iterator)  # a batch handed over: this pass stays epoch 0, whatever set_epoch says now
    iterator = iter(
        whole
    )  # a new pass (epoch 0 again), then the epoch is set before its first batch
    whole.sampler.set_epoch(1)
    assert flat(iterator) == epochs[1]
    resumed = build()
    resumed.load_state_dict(
        {**ended, "epoch": 0, "batches_yielded": len(epochs[0]) // 2, "finished_epoch": None}
    )
    iterator = iter(resumed)  # epoch 0's empty rest, its order drawn by the workers
    resumed.sampler.set_epoch(1)
    assert flat(iterator) == epochs[1]
