"""The isolated loader's probe of the loop (issue 39): a loop that waits moves to threads of this
process mid-epoch, once, with every batch still once and in order, and the state still exact."""

import time

import pytest

from recipes.common import make_loader
from recipes.common.loading.isolated_loader import IsolatedLoader
from recipes.common.loading.loop_probe import LoopProbe
from tests.common.loading.test_isolated_loader import Records

N = LoopProbe.EARLY + 40  # batches of one sample: the move happens inside the first epoch


def _busy():  # Python on a CPU between batches (an eager step)
    end = time.perf_counter() + 0.003
    while time.perf_counter() < end:
        pass


def _epoch(loader, step):
    got = []
    for batch in loader:
        got += batch["ids"].tolist()
        step()
    return got


def test_a_waiting_loop_moves_to_this_process_mid_epoch_each_batch_once_in_order():
    loader = make_loader(Records(N), batch_size=1)  # auto: the child's threads, the loop measured
    assert isinstance(loader, IsolatedLoader) and loader.adaptive
    moved_at = []

    def wait():
        time.sleep(0.003)  # the step waits on the device, GIL released
        if loader.in_process and not moved_at:
            moved_at.append(len(got))

    got = []
    for batch in loader:
        got += batch["ids"].tolist()
        wait()
    assert got == list(range(N))  # the in-order sampler's batches, each once, across the move
    assert moved_at and LoopProbe.EARLY <= moved_at[0] <= LoopProbe.EARLY + 1
    assert loader.child_pid is None  # the child ended once its batches were handed over
    assert f"from batch {LoopProbe.EARLY} of this epoch" in loader.recipe.reasons["path_measured"]
    # The next epoch stays in this process (the loop still waits); a busy loop goes back to the
    # child.
    assert _epoch(loader, wait) == list(range(N)) and loader.in_process
    assert _epoch(loader, _busy) == list(range(N)) and loader.in_process
    assert (
        _epoch(loader, _busy) == list(range(N))
        and not loader.in_process
        and loader.child_pid is not None
    )
    loader.close()


def test_a_state_saved_after_the_move_resumes_exactly():
    loader = IsolatedLoader(
        Records(N), batch_size=1, threads=2, seed=3, adaptive=True, shuffle=True
    )
    batches = iter(loader)
    first = []
    for _ in range(N - 20):
        first += next(batches)["ids"].tolist()
        time.sleep(0.003)
    assert loader.in_process
    state = loader.state_dict()
    rest = [
        i for batch in batches for i in batch["ids"].tolist()
    ]  # the expectation: the epoch, uninterrupted
    loader.close()
    again = IsolatedLoader(Records(N), batch_size=1, threads=2, seed=3, shuffle=True)
    again.load_state_dict(state)
    assert _epoch(again, lambda: None) == rest and sorted(first + rest) == list(range(N))
    again.close()


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_busy_loop_or_a_given_path_never_moves(adaptive):
    loader = IsolatedLoader(Records(N), batch_size=1, threads=2, adaptive=adaptive)
    step = _busy if adaptive else (lambda: time.sleep(0.003))
    assert (
        _epoch(loader, step) == list(range(N))
        and not loader.in_process
        and loader.child_pid is not None
    )
    loader.close()
