"""The isolated loader's probe of the training loop: how much of its time between batches the loop's
thread is on a CPU.

Use when: reading why `make_loader`'s isolated path moved to threads of this process
(`loader.recipe.reasons["path_measured"]`), or tuning when it does (`LoopProbe.LOW`, `HIGH`).
Cost: two clock reads (`perf_counter`, `thread_time`) per batch, in the loop's thread.
Adapt here: `LOW`, `HIGH`.
Trade-off: the CPU time cannot tell Python (which holds the GIL) from a computation that
releases it: either keeps the child (beside the second the two paths are about even,
`recipes bench step`'s last rows); only a loop that mostly waits (on the device, GIL
released) moves to threads of this process, where its hand-over costs less (see NOTE [the GIL
and the thread paths], loader_path.py). The decision is taken at each epoch's start from the
last epoch's batches, and once mid-epoch, after an epoch's first `EARLY` batches on the child,
towards threads of this process only.
Copy with: common/loader_warning.py, common/loading/epoch_read_ahead.py,
  common/loading/loader_path.py, common/loading/stateful_loader.py, common/loading/thread_loader.py,
  common/resume/batch_seeds.py, common/resume/dataset_state.py, common/resume/elastic_rest.py,
  common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/workers/start_watch.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from recipes.common.loading.thread_loader import _Batches


class LoopProbe:
    """The loop's thread between batches: its wall time and its CPU time (`time.thread_time`),
    summed over the last epoch's batches. A thread on a CPU for most of that time runs Python
    or computes; one that mostly waits leaves the GIL to threads of its own process, which then
    hand batches over for less."""

    # See NOTE [the GIL and the thread paths]

    # the CPU share below which threads of this process serve, above which the child does
    LOW = 0.10
    HIGH = 0.20
    # an epoch's batches on the child after which a loop that waits moves at once, mid-epoch
    EARLY = 48

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.gaps = 0
        self.in_process = False
        self.share: float | None = None

    def decide(self, loader) -> bool:
        """Whether the coming epoch runs in this process; updates `loader.recipe`'s reason."""
        if self.gaps >= 8 and self.wall >= 0.05:
            self.share = self.cpu / self.wall
            threshold = self.LOW
            if self.in_process:
                threshold = self.HIGH
            if self.in_process != (self.share < threshold):
                self.in_process = not self.in_process
                _note(loader, self)
        self.wall = self.cpu = 0.0
        self.gaps = 0
        return self.in_process

    def early(self, loader) -> bool:
        """Whether the loop moves to threads of this process now, mid-epoch: once, after the
        epoch's first `EARLY` batches on the child, when the loop's thread was on a CPU under
        `LOW` of that time (a long first epoch need not run its whole length on the child).
        Back to the child is decided at an epoch's start only (forking beside running threads is not
        safe)."""
        if not loader.adaptive or self.in_process or loader.in_process or self.gaps != self.EARLY:
            return False
        if self.wall < 0.05 or self.cpu / self.wall >= self.LOW:
            return False
        self.share = self.cpu / self.wall
        self.in_process = True
        _note(loader, self, mid_epoch=True)
        return True


def _note(loader, probe: LoopProbe, mid_epoch: bool = False) -> None:
    recipe = getattr(loader, "recipe", None)
    if recipe is None:
        return
    measured = (
        f"measured: the loop's thread was on a CPU {probe.share:.0%} of its time between batches"
    )
    if not probe.in_process:
        recipe.reasons["path_measured"] = (
            f"{measured} (it runs Python) -> the child's threads again"
        )
        return
    since = "this epoch"
    if mid_epoch:
        since = f"batch {probe.EARLY} of this epoch"
    recipe.reasons["path_measured"] = (
        f"{measured} (the step waits, GIL released) -> threads of this process from {since}"
    )


@dataclass(frozen=True)
class _Clocks:
    """The loop's thread's clocks at one moment: wall (`perf_counter`) and CPU (`thread_time`)."""

    wall: float
    cpu: float


class TimedBatches(_Batches):
    """The epoch's batches, the loop's time between them measured for the loader's `LoopProbe`."""

    def __init__(self, loader, indices, current):
        super().__init__(loader, indices, current)
        self._left: _Clocks | None = None  # the clocks as the loop received the last batch

    def __next__(self):
        loader = self._loader
        if self._left is not None:
            probe = loader._probe
            probe.wall += time.perf_counter() - self._left.wall
            probe.cpu += time.thread_time() - self._left.cpu
            probe.gaps += 1
            if probe.early(loader):  # the next batches are asked of this process's threads; the
                loader._in_process_pool()  # child's, asked already, still come from the child
        if loader._child is not None and loader.in_process:
            loader._retire_child(self._pending)
        try:
            return super().__next__()
        finally:
            self._left = _Clocks(time.perf_counter(), time.thread_time())
