"""What reached the training loop: the batches counted as they are handed over, and which
errors leave a batch behind the loop.

Use when: you read how `StatefulLoader` knows the batches the loop received (`Counting` wraps
DataLoader's iterator), or why a failed batch does or does not count (`used_up`).
Cost: one counter increment per batch; a `Carried` batch (a worker's dataset state with it,
`dataset_state.py`) is unwrapped, and a worker's stream end taken in.
Adapt here: `SHM_FAILURES`, the texts of a full /dev/shm.
Trade-off: a pass left by the loop (`break`, an error) is paused, not ended (`loader_passes.py`).
Copy with: common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/loader_contract.py.
"""

from __future__ import annotations

import weakref

from recipes.common.resume.dataset_state import Carried


class Counting:
    """The DataLoader iterator, counting what reaches the loop; other attributes pass through
    (`_workers`, for LoaderMonitor and RobustLoader). Dropped before its end (`break`), it
    ends its pass."""

    def __init__(self, passes, current, inner):  # `loader_passes.Passes`, its current `Pass`
        self._passes, self._pass, self._inner = passes, current, inner
        current.inner = weakref.ref(inner)

    def _target(self):
        latest = self._passes.current
        # persistent workers: an older iterator of the loader reads the latest pass's batches
        shared = latest is not None and latest is not self._pass and latest.inner is not None \
            and latest.inner() is self._inner
        return latest if shared else self._pass

    def __iter__(self):
        return self

    def __next__(self):
        if self._target().closed:  # its workers (or threads) were shut down under it
            raise LoaderClosedError("this loader was closed while its epoch was running; start a new epoch with "
                                    "iter(loader) (or load a saved state_dict() to continue there).")
        while True:
            try:
                batch = next(self._inner)
            except StopIteration:
                self._passes.keep_main_state(self._target(), self._inner)
                self._target().done = True
                raise
            except Exception as error:
                if used_up(error, self._inner):  # the dataset's error: that batch's position is used up
                    self._target().yielded += 1
                raise
            target = self._target()
            if isinstance(batch, Carried):  # a worker's batch (or stream end) with its dataset copy's state
                target.dataset_states[batch.worker], target.last_worker = batch.state, batch.worker
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
SHM_FAILURES = ("no space left on device", "unable to write to file </torch_", "unable to allocate shared memory",
                "bus error", "out of shared memory")


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
