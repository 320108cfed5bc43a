"""The draws of a `MixtureIterable` consumer (one worker of one rank): which source gives its
next sample, and the interleave of its sources by the stop rules.

Use when: you read or change how `MixtureIterable` picks a source. Two rules:
`IidDraws` (fixed weights in samples: each sample's source drawn at random, proportional to
the weights of the sources still yielding) and `PacedDraws` (a schedule, or shares in tokens:
the source furthest behind its target share, with a small seeded jitter).
Cost: per sample, one draw over the sources (a few numpy operations); a schedule's weights
are evaluated once per sample (`mixture_schedule.py`).
Adapt here: `JITTER` (how far the paced rule strays from the strict deficit order).
Trade-off: the paced rule holds the shares within about one sample's length at all times in
each consumer, where the random draw holds them only on average (binomial deviations); its
order is less random (a source's samples come at nearly regular intervals, the jitter breaking
ties and exact periods).
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

# The paced rule's random term, in units of the mean sample length so far: enough to vary
# the order, small enough to keep each source within about one sample of its share.
JITTER = 0.5


class IidDraws:
    """Each sample's source drawn at random with probability proportional to its weight among
    the active sources (the draw of fixed weights in samples)."""

    def __init__(self, weights: np.ndarray, rng: np.random.Generator):
        self.weights = weights
        self.rng = rng

    def pick(self, active: np.ndarray) -> int:
        p = np.where(active, self.weights, 0.0)
        return int(self.rng.choice(len(p), p=p / p.sum()))

    def took(self, source: int, length: int) -> None:
        """Nothing to keep: each draw is independent."""


class Progress(NamedTuple):
    """Where a consumer's units stand on the schedule: `start + own units x scale`."""

    start: float  # the progress (schedule units) done before this consumer's first sample
    scale: int  # consumers reading at once (ranks x workers): each one's share of the progress
    tokens: bool  # progress counts tokens (else samples)


class PacedDraws:
    """The active source furthest behind its target share: the target grows by the weights at
    the current progress times each sample's length, and the source with the largest
    `target - units + jitter` (after the next sample of the mean length) is drawn.

    Args:
        weights_at: progress (schedule units) -> weights `[1, S]` (S: sources), a row summing
            to 1.
        rng: the jitter's generator.
        progress: where this consumer's units place it on the schedule.
        usable: the sources that may be drawn at all (fixed weights: those above 0).
    """

    def __init__(
        self,
        weights_at: Callable[[float], np.ndarray],
        rng: np.random.Generator,
        progress: Progress,
        usable: np.ndarray,
    ):
        self.weights_at = weights_at
        self.rng = rng
        self.progress = progress
        self.usable = usable
        sources = len(usable)
        self.target = np.zeros(sources)
        self.units = np.zeros(sources)
        self.samples = 0
        self.tokens = 0
        self._weights = np.zeros(sources)

    def position(self) -> float:
        """This consumer's place on the schedule (in its units)."""
        own = self.samples
        if self.progress.tokens:
            own = self.tokens
        return self.progress.start + own * self.progress.scale

    def pick(self, active: np.ndarray) -> int:
        weights = np.where(active, self.weights_at(self.position())[0], 0.0)
        if weights.sum() <= 0:  # the scheduled sources have ended: the rest evenly
            weights = active.astype(np.float64)
        self._weights = weights / weights.sum()
        mean = max(self.units.sum() / max(self.samples, 1), 1.0)
        jitter = (self.rng.random(len(weights)) - 0.5) * (JITTER * mean)
        score = self.target + self._weights * mean - self.units + jitter
        score[self._weights <= 0] = -np.inf
        return int(np.argmax(score))

    def took(self, source: int, length: int) -> None:
        self.target += self._weights * length
        self.units[source] += length
        self.samples += 1
        self.tokens += length


class Interleave(NamedTuple):
    """How a consumer interleaves its sources: its draws, the stop rule, and how sources are
    measured and restarted."""

    draws: IidDraws | PacedDraws
    stop: str
    length: Callable[[Any], int] | None  # a sample's units; None: 1 each
    restart: Callable[[int], Iterator]  # a source's iterator again ("never", cycling)


_END = object()


def interleaved(iterators: list[Iterator], active: np.ndarray, rule: Interleave) -> Iterator:
    """`(source, sample)` pairs of the sources `iterators` by `rule`, `active` the sources that
    may be drawn (changed in place as sources end)."""
    ended = ~active  # "cycle_until_all_exhausted": the sources that have ended once
    while active.any():
        s = rule.draws.pick(active)
        item = next(iterators[s], _END)
        if item is _END:
            if rule.stop == "first_exhausted":
                return
            ended[s] = True
            if rule.stop == "cycle_until_all_exhausted" and ended.all():
                return
            if rule.stop in ("never", "cycle_until_all_exhausted"):
                iterators[s] = rule.restart(s)
                item = next(iterators[s], _END)
            if item is _END:
                active[s] = False
                continue
        length = 1
        if rule.length is not None:
            length = int(rule.length(item))
        rule.draws.took(s, length)
        yield s, item
