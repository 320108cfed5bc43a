"""A mixture's plan of one epoch, in segments: the epoch's draw, then its rest re-drawn at each
change of weights the training loop made (`MixtureSampler.set_weights`).

Use when: a `MixtureSampler` needs its current epoch's indices (`EpochDraws.indices`, from the
position `first`), moves to the next epoch (the progress and the loop's weights carry over),
changes its weights mid-epoch, or saves and restores the segments a resume needs.
Cost: a change re-draws the epoch's rest from its position (`mixture_pacing.py`: one sort of
the rest's candidate draws); moving to epoch e from epoch 0 with a schedule draws every epoch
before it once (the progress is counted from the plans).
Adapt here: nothing; the draws themselves are `mixture_plan.py`'s (i.i.d., fixed weights in
samples) and `mixture_pacing.py`'s (schedules, tokens, weights set by the loop).
Trade-off: only the segments from the one holding the resume position on are kept in a state
(O(sources) each, not O(changes)): the positions before it are not regenerated on resume, so
a resumed epoch's padding repeats its first known indices rather than the epoch's first.
Copy with: common/sampling/mixture_plan.py, common/sampling/mixture_weights.py,
  common/sampling/pacing/mixture_pacing.py, common/sampling/pacing/mixture_schedule.py.
"""

from __future__ import annotations

import numpy as np

from recipes.common.sampling.mixture_plan import MixturePlan
from recipes.common.sampling.pacing.mixture_pacing import (
    FixedPace,
    PacedPlan,
    SchedulePace,
    Segment,
)


class EpochDraws:
    """One epoch's indices into `ConcatDataset(datasets)` from position `first` on, drawn in
    `segments` (oldest first; `segments[0].start == first`).

    Args:
        planner: the mixture's i.i.d. planner (its sizes, stop rule, seed and passes).
        paced: the paced planner.
        pace: the sampler's own weights as a pace (`FixedPace`, or `SchedulePace`).
        units: per `ConcatDataset` index, its units (tokens), or None (one per sample).
        iid: whether the epoch's first segment is the i.i.d. draw (fixed weights in samples).
    """

    def __init__(
        self,
        planner: MixturePlan,
        paced: PacedPlan,
        pace,
        units: np.ndarray | None,
        *,
        iid: bool,
    ):
        self.planner = planner
        self.paced = paced
        self.pace = pace
        self.units = units
        self.iid = iid
        self.epoch = -1
        self.first = 0
        self.indices = np.empty(0, np.int64)
        self.segments: list[Segment] = []

    @classmethod
    def build(cls, planner: MixturePlan, lengths: list[np.ndarray] | None, schedule) -> EpochDraws:
        """The draws of a mixture with these per-source `lengths` (or None) and `schedule` (a
        `BoundSchedule`, or None: the planner's fixed weights): i.i.d. without either."""
        pace = FixedPace(planner.weights)
        if schedule is not None:
            pace = SchedulePace(schedule)
        units = None
        if lengths is not None:
            units = np.concatenate(lengths)
        iid = schedule is None and lengths is None
        return cls(planner, PacedPlan(planner, lengths), pace, units, iid=iid)

    # ---- epochs ----------------------------------------------------------------------------
    def start(self, epoch: int, progress: int, weights: tuple[float, ...] | None) -> None:
        """Draws `epoch` from its start, at `progress`, under the loop's `weights` (or None)."""
        cursors = tuple([0] * len(self.planner.sizes))
        self.restore(epoch, [Segment(0, int(progress), cursors, weights, 0)])

    def restore(self, epoch: int, segments: list[Segment]) -> None:
        """Draws `epoch` from the first of `segments` on, each cut where the next begins."""
        self.epoch = int(epoch)
        self.first = segments[0].start
        self.segments = []
        self.indices = np.empty(0, np.int64)
        for segment in segments:
            self._apply(segment)

    def advance(self, epoch: int) -> None:
        """Moves to `epoch`: forward from the current epoch, carrying its end's progress and
        the loop's weights; from epoch 0 otherwise."""
        epoch = int(epoch)
        if epoch == self.epoch:
            return
        if self.epoch < 0 or epoch < self.epoch:
            self.start(0, 0, None)
        if not self.counts_progress():  # nothing carries but the loop's weights
            self.start(epoch, 0, self.segments[-1].weights)
            return
        while self.epoch < epoch:
            self.start(self.epoch + 1, self.end_progress(), self.segments[-1].weights)

    def other(self, epoch: int, last: EpochDraws | None) -> EpochDraws:
        """Another epoch's draws, on a copy (this one stays): on from `last` (the other epoch
        drawn before, when it is not past `epoch` and not before this one), else from this
        epoch when `epoch` is later (its progress and weights carry over), else from epoch 0."""
        if last is None or last.epoch > epoch or last.epoch < self.epoch:
            last = EpochDraws(self.planner, self.paced, self.pace, self.units, iid=self.iid)
            if epoch > self.epoch:
                last.restore(self.epoch, self.segments)
        last.advance(epoch)
        return last

    def counts_progress(self) -> bool:
        """Whether the weights depend on the progress (a schedule)."""
        return not isinstance(self.pace, FixedPace)

    def end_progress(self) -> int:
        """The units planned since epoch 0 by the end of this epoch."""
        return self.segments[0].progress + self.count_units(self.indices)

    # ---- changes ---------------------------------------------------------------------------
    def change(self, position: int, weights: tuple[float, ...]) -> Segment:
        """Re-draws the epoch from plan `position` on under `weights`; the positions before it
        stay. A change at an earlier segment's start replaces that segment."""
        position = max(int(position), self.first)
        kept = [s for s in self.segments if s.start < position]
        number = self.segments[-1].number + 1
        if not kept:  # at the known part's start: its first segment replaced
            base = self.segments[0]
            segment = Segment(position, base.progress, base.cursors, weights, number)
            self.restore(self.epoch, [segment])
            return segment
        done = self.indices[: position - self.first]
        base = kept[0]
        cursors = np.asarray(base.cursors, np.int64)
        cursors = cursors + np.bincount(self.source_of(done), minlength=len(cursors))
        progress = base.progress + self.count_units(done)
        segment = Segment(position, progress, tuple(cursors.tolist()), weights, number)
        self.segments = kept
        self._apply(segment)  # the positions before it stay as drawn
        return segment

    def needed(self, position: int) -> list[Segment]:
        """The segments a resume at plan `position` needs: the one holding it and later ones."""
        holding = [s for s in self.segments if s.start <= position]
        if not holding:
            return list(self.segments)
        return [holding[-1]] + [s for s in self.segments if s.start > position]

    # ---- what it drew ----------------------------------------------------------------------
    def source_of(self, indices) -> np.ndarray:
        offsets = self.planner.offsets
        return np.searchsorted(offsets, np.asarray(indices, np.int64), side="right") - 1

    def count_units(self, indices: np.ndarray) -> int:
        if self.units is None:
            return len(indices)
        return int(self.units[indices].sum())

    def total(self) -> int:
        """The epoch's length: the known positions and those before them."""
        return self.first + len(self.indices)

    def _apply(self, segment: Segment) -> None:
        """Cuts the indices at `segment.start` and draws the rest from it."""
        keep = self.indices[: max(segment.start - self.first, 0)]
        limit = None
        if self.planner.num_samples is not None:
            limit = self.planner.num_samples - segment.start
        if self.iid and segment.number == 0 and segment.weights is None:
            rest = self.planner.draw(self.epoch).indices[segment.start :]
            if limit is not None:
                rest = rest[: max(limit, 0)]
        else:
            pace = self.pace
            if segment.weights is not None:
                pace = FixedPace(np.asarray(segment.weights, np.float64))
            rest = self.paced.draw(self.epoch, segment, pace, limit)
        self.indices = np.concatenate([keep, rest])
        self.segments.append(segment)
