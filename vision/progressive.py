"""Progressive resizing: train at low resolution first, full resolution at the end.

Use when: training a CNN for many epochs; early epochs at 128-160 px cost a third to a half
of full-resolution epochs (fewer pixels to decode, augment, transfer and convolve), with
little accuracy lost (the FFCV ImageNet recipes; "Fixing the train-test resolution
discrepancy", Touvron et al. 2019).
Cost: nothing per sample; `ImageFolderFast` decodes at a coarser DCT scale at low resolution.
Adapt here: `start`, `end`, the epoch range and `step` (keep it a multiple of 32 for CNNs).
Trade-off: batch statistics shift when the resolution changes; end at the eval resolution.

The resolution lives in shared memory inside the dataset, so `dataset.set_resolution()` in
the main process before `iter(loader)` reaches persistent workers too.
Copy with: nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressiveResolution:
    """A linear low-to-high resolution schedule, rounded down to multiples of `step`.

    Example:
        >>> schedule = ProgressiveResolution(start=128, end=224, start_epoch=0, end_epoch=8)
        >>> [schedule.resolution(e) for e in (0, 4, 8, 20)]
        [128, 160, 224, 224]
    """

    start: int = 128
    end: int = 224
    start_epoch: int = 0
    end_epoch: int = 10
    step: int = 32

    def __post_init__(self):
        for name in ("start", "end", "step"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
        if self.end_epoch < self.start_epoch:
            raise ValueError(
                f"`end_epoch` must be at least `start_epoch` ({self.start_epoch}), "
                f"but is {self.end_epoch!r} instead."
            )

    def resolution(self, epoch: int) -> int:
        """The resolution for `epoch`: `start` before `start_epoch`, `end` from `end_epoch` on."""
        if epoch <= self.start_epoch:
            return self.start
        if epoch >= self.end_epoch:
            return self.end
        fraction = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        value = self.start + fraction * (self.end - self.start)
        return max(self.step, int(value // self.step) * self.step)

    def apply(self, dataset, epoch: int) -> int:
        """Sets `dataset`'s resolution for `epoch` (call before `iter(loader)`); returns it."""
        size = self.resolution(epoch)
        dataset.set_resolution(size)
        return size
