"""What reached the training loop: the batches counted as they are handed over, and which
errors leave a batch behind the loop.

Use when: you read how `StatefulLoader` knows the batches the loop received (`Counting` wraps
DataLoader's iterator), or why a failed batch does or does not count (`used_up`).
Cost: one counter increment per batch; a `Carried` batch (a worker's dataset state with it,
`dataset_state.py`) is unwrapped, and a worker's stream end taken in.
Adapt here: `SHM_FAILURES`, the texts of a full /dev/shm.
Trade-off: a pass left by the loop (`break`, an error) is paused, not ended (`loader_passes.py`).
An iterator that has handed no batch over yet begins its pass again at its first `next()` when
a state was loaded after `iter(loader)`, or `set_epoch` chose another epoch after its order was
drawn (workers draw at `iter()`): the workers' read-ahead of the old order is dropped. Lightning
calls `iter()` before it sets the sampler's epoch, and before it restores a checkpoint when
`configure_optimizers` reads `trainer.estimated_stepping_batches` (#20550); a late state or
epoch must not wait for the next epoch's `iter()`. Once a batch was handed over, a loaded
state waits for the next `iter()`, as before.
Copy with: common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/loader_contract.py, common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from recipes.common.resume.dataset_state import Carried


class Counting:
    """The DataLoader iterator, counting what reaches the loop; other attributes pass through
    (`_workers`, for LoaderMonitor and RobustLoader). Dropped before its end (`break`), it
    ends its pass."""

    def __init__(self, passes, current, inner, restart: Callable | None = None):
        # `passes`: the loader's `loader_passes.Passes`; `current`: the `Pass` begun for this
        # iterator; `restart`: a weak method of the loader that begins a pass anew, returning
        # (pass, inner iterator): called when the pass is superseded before this handed a batch
        # over (a state loaded, or another epoch set: `Passes.superseded`)
        self._passes = passes
        self._pass = current
        self._inner = inner
        self._restart = restart
        current.inner = weakref.ref(inner)

    def _target(self):
        latest = self._passes.current
        # persistent workers: an older iterator of the loader reads the latest pass's batches
        shared = (
            latest is not None
            and latest is not self._pass
            and latest.inner is not None
            and latest.inner() is self._inner
        )
        return latest if shared else self._pass

    def __iter__(self):
        return self

    def _begin_again(self) -> None:
        """The pass, superseded before a batch was handed over (`Passes.superseded`), begins
        again: the loaded state's, or the epoch `set_epoch` chose (the old read-ahead dropped)."""
        current = self._pass
        if self._restart is None:
            return
        start = self._restart()
        if start is None:  # the loader is gone
            return
        old = self._inner
        self._pass, self._inner = start()
        self._pass.inner = weakref.ref(self._inner)
        current.done = current.dropped = True  # superseded, never received
        if old is not self._inner and hasattr(old, "_shutdown_workers"):
            # its workers read ahead in the old order (persistent ones are reset, not here)
            old._shutdown_workers()

    def __next__(self):
        if self._pass.yielded == self._pass.skip and self._passes.superseded(self._pass):
            self._begin_again()
        if self._target().closed:  # its workers (or threads) were shut down under it
            raise LoaderClosedError(
                "this loader was closed while its epoch was running; start a new epoch with "
                "iter(loader) (or load a saved state_dict() to continue there)."
            )
        while True:
            try:
                batch = next(self._inner)
            except StopIteration:
                self._passes.keep_main_state(self._target(), self._inner)
                self._target().done = True
                raise
            except Exception as error:
                if used_up(
                    error, self._inner
                ):  # the dataset's error: that batch's position is used up
                    self._target().yielded += 1
                raise
            target = self._target()
            if isinstance(
                batch, Carried
            ):  # a worker's batch (or stream end) with its dataset copy's state
                target.dataset_states[batch.worker] = batch.state
                target.last_worker = batch.worker
                if batch.ended and batch.batch is None:
                    continue  # the end of a worker's stream: not a batch
                batch = batch.batch
            target.yielded += 1
            return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __del__(self):
        if self._pass is self._passes.current and not self._pass.done:
            self._passes.keep_main_state(self._pass, self._inner)  # (before its iterator goes)
            self._pass.done = self._pass.dropped = True


# What a worker's error says when shared memory ran out: the batch was not made for lack of
# room, and a restart with less in flight (RobustLoader) makes it again.
SHM_FAILURES = (
    "no space left on device",
    "unable to write to file </torch_",
    "unable to allocate shared memory",
    "bus error",
    "out of shared memory",
)


def used_up(error: BaseException, inner) -> bool:
    """Whether the batch whose making raised `error` is behind the loop now: a dataset's error
    re-raised for its batch (from a worker, "Caught ... in DataLoader worker process"; in the
    loop's own process; from a pool thread, `failed_batches_are_used`). DataLoader's own
    failures (a worker died, a timeout, a full /dev/shm, a broken pipe) leave the batch unmade:
    a restart (`RobustLoader`) makes it again."""
    judge = getattr(inner, "failed_batches_are_used", None)
    if judge is not None:
        return bool(judge(error))
    text = str(error)
    if any(s in text.lower() for s in SHM_FAILURES):
        return False
    if "in DataLoader worker process" in text:
        return True
    return getattr(inner, "_num_workers", 1) == 0  # no workers: every error is the dataset's


class LoaderClosedError(RuntimeError):
    """The loader was closed (`close()`, `with loader:`) while an epoch's iterator was in use."""
