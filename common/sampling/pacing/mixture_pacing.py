"""Paced mixing: each source's samples placed where its share of the progress falls due, so the
mixture holds its shares (of samples, or of tokens) at every position, under weights that move.

Use when: a `MixtureSampler` has a `Schedule`, per-sample `lengths` (shares in tokens), or
weights set by the training loop (`set_weights`); fixed weights in samples keep the i.i.d. draw
of `mixture_plan.py`.
Cost: per segment of an epoch (the epoch, or its rest after a `set_weights`), one sort of the
candidate draws by their due time (O(N log N) for N positions, vectorised) and, for a
schedule, one table of its cumulative weights (`GRID` points, once per sampler).
Adapt here: `GRID` (the schedule table's resolution), the jitter in `_due`.
Trade-off: a source's k-th sample is placed at the progress t where the source's cumulative
target share reaches the tokens (or samples) it has given so far plus a seeded random part
of the sample's own length: every source stays within about one sample's length of its
target at every position (a window of W tokens holds its shares within about
2 x longest sample / W), instead of the binomial spread of an i.i.d. draw; the interleave is
paced rather than independent per position (the samples within a source stay in a random
order). The plan stays a pure function of the seed, the epoch and the segment's start
(`Segment`): a resume regenerates it.

NOTE [paced mixing]: with W_s(t) = the integral of source s's weight from the segment's start
to progress t, the k-th draw of s (counted in the segment) is due when W_s(t) reaches
`sum(l[:k]) + u_k * l[k]` (l: the draws' lengths, u_k uniform in [0, 1) from the seed). The
segment's positions are the draws sorted by due time (ties by source). The weights are
normalised at every t, so the units planned by progress t are t minus the start, up to about
one sample per source.
Copy with: common/sampling/mixture_plan.py, common/sampling/mixture_weights.py,
  common/sampling/pacing/mixture_schedule.py.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from recipes.common.sampling.mixture_plan import MixturePlan
from recipes.common.sampling.pacing.mixture_schedule import BoundSchedule

# Cells of a schedule's cumulative-weight table over its `total` (the phases' points are
# added to the grid, so a step schedule is exact).
GRID = 8192


class Segment(NamedTuple):
    """Where a paced part of an epoch begins, and what it is drawn from."""

    start: int
    """The plan's position (samples over all ranks) where the segment begins."""
    progress: int
    """The units (samples, or tokens with lengths) planned since epoch 0 before `start`."""
    cursors: tuple[int, ...]
    """Per source, its draws in the epoch before `start` (its next draw's number)."""
    weights: tuple[float, ...] | None
    """Weights set by the training loop (normalised), or None: the sampler's own."""
    number: int
    """The segment's number within the epoch (0: the epoch's start), part of its seed."""


class FixedPace:
    """Constant weights: source s's cumulative target grows as `w_s * (t - start)`."""

    def __init__(self, weights: np.ndarray):
        self.weights = np.asarray(weights, np.float64)

    def at(self, progress: float) -> np.ndarray:
        return self.weights

    def times(self, source: int, start: float, due: np.ndarray) -> np.ndarray:
        weight = self.weights[source]
        if weight <= 0:
            return np.full(len(due), np.inf)
        return start + due / weight


class SchedulePace:
    """A schedule's weights: each source's cumulative target from a table over its progress
    (exact between the phases' points; beyond `total` the last weights hold)."""

    def __init__(self, schedule: BoundSchedule):
        self.schedule = schedule
        self._table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def grid(self) -> np.ndarray:
        return self._tabulated()[0]

    @property
    def cumulative(self) -> np.ndarray:
        return self._tabulated()[1]

    @property
    def last(self) -> np.ndarray:
        return self._tabulated()[2]

    def _tabulated(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The grid, each source's cumulative weight on it, and the last weights: made at the
        first draw, not when a sampler is built (a function schedule is called per point)."""
        if self._table is None:
            schedule = self.schedule
            grid = np.linspace(0.0, float(schedule.total), GRID + 1)
            grid = np.unique(np.concatenate([grid, schedule.breakpoints()]))
            weights = schedule.weights_at(grid)  # [G, S]
            steps = np.diff(grid)[:, None]
            if schedule.stepwise():  # each cell at its left point's weights
                areas = weights[:-1] * steps
            else:
                areas = (weights[:-1] + weights[1:]) / 2 * steps
            cumulative = np.vstack([np.zeros(weights.shape[1]), np.cumsum(areas, axis=0)])
            self._table = (grid, cumulative, weights[-1])
        return self._table

    def at(self, progress: float) -> np.ndarray:
        return self.schedule.weights_at([progress])[0]

    def target(self, source: int, t: np.ndarray) -> np.ndarray:
        """W_s(t): source s's cumulative target from progress 0 to each `t`."""
        table = self.cumulative[:, source]
        inside = np.interp(t, self.grid, table)
        beyond = table[-1] + (t - self.grid[-1]) * self.last[source]
        return np.where(t > self.grid[-1], beyond, inside)

    def times(self, source: int, start: float, due: np.ndarray) -> np.ndarray:
        """The progress at which source s's cumulative target since `start` reaches `due`:
        the first such point (a weight of 0 holds a draw until the weight returns)."""
        table = self.cumulative[:, source]
        goal = self.target(source, np.asarray([start], np.float64))[0] + due
        cell = np.searchsorted(table, goal, side="left")
        out = np.full(len(goal), np.inf)
        inside = (cell > 0) & (cell < len(table))
        low = cell[inside] - 1
        rise = table[low + 1] - table[low]
        share = (goal[inside] - table[low]) / rise
        out[inside] = self.grid[low] + share * (self.grid[low + 1] - self.grid[low])
        out[goal <= table[0]] = start
        after = cell >= len(table)
        if self.last[source] > 0:
            extra = (goal[after] - table[-1]) / self.last[source]
            out[after] = self.grid[-1] + extra
        return np.maximum(out, start)


class Candidates(NamedTuple):
    """A segment's candidate draws, all sources together."""

    source: np.ndarray
    """int64: each draw's source."""
    local: np.ndarray
    """int64: each draw's index within its source."""
    time: np.ndarray
    """float64: each draw's due progress."""
    complete_until: float
    """The progress up to which every source's candidates are complete."""


class PacedPlan:
    """Draws a paced segment of an epoch (`plan`: the mixture's `MixturePlan`, for its sizes,
    stop rule, seed and each source's pass permutations)."""

    def __init__(self, plan: MixturePlan, lengths: list[np.ndarray] | None):
        self.plan = plan
        self.lengths = lengths
        if lengths is None:
            self.mean = np.ones(len(plan.sizes))
        else:
            self.mean = np.asarray([max(float(x.mean()), 1.0) for x in lengths])

    def draw(self, epoch: int, segment: Segment, pace, limit: int | None) -> np.ndarray:
        """The segment's indices into `ConcatDataset(datasets)`, from `segment.start` to the
        epoch's end under its stop rule (at most `limit` positions)."""
        sizes = self.plan.sizes
        cursors = np.asarray(segment.cursors, np.int64)
        stop = self.plan.stop
        if stop == "first_exhausted" and (cursors >= sizes).any():
            return np.empty(0, np.int64)
        if limit is not None and limit <= 0:
            return np.empty(0, np.int64)
        counts = self._first_counts(segment, pace, cursors, limit)
        while True:
            found = self._candidates(epoch, segment, pace, cursors, counts)
            end, short = self._end(found, cursors, limit)
            if not short.any():
                break
            counts = np.where(short, counts * 2 + 16, counts)
        order = np.lexsort((found.source, found.time))
        due = found.time[order]
        taken = order[np.isfinite(due) & (due <= end)]  # a draw never due is never drawn
        if limit is not None:
            taken = taken[:limit]
        return self.plan.offsets[found.source[taken]] + found.local[taken]

    def _first_counts(self, segment, pace, cursors, limit) -> np.ndarray:
        """Draws per source to try first: a single pass's rest for the exhausting rules, else
        the start's shares of the positions needed."""
        sizes = self.plan.sizes
        if self.plan.stop in ("drop_exhausted", "first_exhausted"):
            return np.maximum(sizes - cursors, 0)
        shares = pace.at(segment.progress) / self.mean
        shares = shares / shares.sum()
        if self.plan.stop == "cycle_until_all_exhausted":
            wanted = int(np.maximum(sizes - cursors, 0).sum())
        else:
            wanted = int(limit)
        return np.ceil(shares * wanted * 1.25).astype(np.int64) + 16

    def _candidates(self, epoch, segment: Segment, pace, cursors, counts) -> Candidates:
        sources = []
        locals_ = []
        times = []
        complete = np.inf
        for s, count in enumerate(counts.tolist()):
            first = int(cursors[s])
            local = self._draws(epoch, s, first, count)
            due = self._due(epoch, segment, s, local)
            time = pace.times(s, float(segment.progress), due)
            sources.append(np.full(len(local), s, np.int64))
            locals_.append(local)
            times.append(time)
            exhausting = self.plan.stop in ("drop_exhausted", "first_exhausted")
            if not exhausting and len(time) and np.isfinite(time[-1]):
                complete = min(complete, float(time[-1]))
        return Candidates(
            np.concatenate(sources), np.concatenate(locals_), np.concatenate(times), complete
        )

    def _draws(self, epoch: int, source: int, first: int, count: int) -> np.ndarray:
        """Source-local indices of its draws `first` to `first + count` in the epoch (pass
        after pass, each a permutation)."""
        if count <= 0:
            return np.empty(0, np.int64)
        size = int(self.plan.sizes[source])
        passes = -(-(first + count) // size)
        return self.plan.passes(epoch, source, passes)[first : first + count]

    def _due(self, epoch: int, segment: Segment, source: int, local: np.ndarray) -> np.ndarray:
        """Each draw's due units since the segment's start (see NOTE [paced mixing])."""
        if self.lengths is None:
            length = np.ones(len(local))
        else:
            length = self.lengths[source][local].astype(np.float64)
        seed = [self.plan.seed, epoch, segment.number, source, 0x7061]
        jitter = np.random.default_rng(seed).random(len(local))
        before = np.concatenate([[0.0], np.cumsum(length)[:-1]])
        return before + jitter * length

    def _end(self, found: Candidates, cursors, limit) -> tuple[float, np.ndarray]:
        """The segment's last due time under the stop rule, and the sources whose candidates
        stop short of it (to be drawn further)."""
        stop = self.plan.stop
        sources = len(self.plan.sizes)
        short = np.zeros(sources, bool)
        finite = np.isfinite(found.time)
        if stop == "drop_exhausted":
            return np.inf, short
        if stop == "first_exhausted":
            lasts = [found.time[found.source == s] for s in range(sources)]
            ends = [float(t[-1]) for t in lasts if len(t) and np.isfinite(t[-1])]
            if not ends:
                return np.inf, short
            return min(ends), short
        if stop == "cycle_until_all_exhausted":
            end = self._cycle_end(found, cursors)
        else:
            times = found.time[finite]
            end = np.inf
            if len(times) >= limit:
                end = float(np.partition(times, limit - 1)[limit - 1])  # the limit-th due
        if end > found.complete_until:
            short = self._short(found, end)
        return end, short

    def _cycle_end(self, found: Candidates, cursors) -> float:
        """The due time of the draw completing the last source's first pass (a source whose
        draws stop being due, its weight 0 from some point on, never completes it: it does not
        hold the epoch open, as in the i.i.d. draw)."""
        end = -np.inf
        for s in range(len(self.plan.sizes)):
            need = int(self.plan.sizes[s]) - int(cursors[s])  # draws until its first pass ends
            if need <= 0:
                continue
            times = found.time[found.source == s]  # non-decreasing: once never due, never
            if len(times) < need:
                if len(times) and not np.isfinite(times[-1]):
                    continue
                return np.inf
            if np.isfinite(times[need - 1]):
                end = max(end, float(times[need - 1]))
        return end  # -inf when every first pass is done: the epoch ended before the segment

    def _short(self, found: Candidates, end: float) -> np.ndarray:
        """The sources whose last candidate is due before `end` (they need more draws)."""
        short = np.zeros(len(self.plan.sizes), bool)
        for s in range(len(self.plan.sizes)):
            times = found.time[found.source == s]
            if len(times) and np.isfinite(times[-1]) and times[-1] < end:
                short[s] = True
        return short
