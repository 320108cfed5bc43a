"""Schedule: a mixture's weights as a function of training progress, in samples or tokens.

Use when: the mixture moves during training (a warm-up mixture, the main one, an annealing
phase that upweights the best sources), given as phases with linear or step interpolation, or
as any picklable function of progress. `MixtureSampler` and `MixtureIterable` take a
`Schedule` wherever they take fixed weights.
Cost: per epoch, one evaluation of the weights on a grid of the epoch's progress (a few
thousand points, vectorised); nothing per sample.
Adapt here: `INTERPOLATIONS` (how weights move between two phases).
Trade-off: progress is counted by the mixture itself from the plan (the samples or tokens it
planned since epoch 0), never read from the training loop, so the plan stays a pure function
of the seed, the epoch and the schedule, and a resume regenerates it; a function given as a
schedule is fingerprinted by its name and its values on a grid, so a changed function is
noticed on resume only where it changes those values.
Copy with: common/sampling/mixture_weights.py.
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from recipes.common.sampling.mixture_weights import WeightedSources, even_weights, parse_sources

OVER = ("samples", "tokens")
INTERPOLATIONS = ("linear", "step")
# The points of progress (fractions of `total`) a function schedule is checked and
# fingerprinted at.
CHECK_GRID = np.linspace(0.0, 1.0, 257)


class Phase(NamedTuple):
    """A schedule's point: from `at` (a fraction of the schedule's total), these weights."""

    at: float
    weights: Mapping[str, float] | Sequence[float]


class Schedule:
    """A mixture's weights over training progress.

    Args:
        phases: `(at, weights)` pairs with `at` a fraction of `total` in [0, 1], the first at 0,
            in increasing order; `weights` a mapping from source name to weight (a source
            left out weighs 0 in that phase) or a sequence, one per source. Or a picklable
            function from progress (a fraction of `total`) to such weights.
        over: "samples" or "tokens": what progress counts. "tokens" needs the samples'
            lengths (`lengths=` on the mixture).
        total: the training run's length in `over` units (progress 1.0); beyond it the last
            weights hold.
        interpolation: "linear" (weights move linearly from one phase's point to the next)
            or "step" (each phase's weights hold until the next).

    Raises:
        ValueError: no phases, a phase out of order or outside [0, 1], a first phase not at 0,
            an unknown `over` or `interpolation`, a non-positive `total`, or a function that
            cannot be pickled. A phase naming an unknown source, or weights without a
            positive sum, are refused when a mixture takes the schedule.

    Example:
        >>> schedule = Schedule(
        ...     [(0.0, {"web": 0.8, "code": 0.2}), (0.9, {"web": 0.5, "code": 0.2, "books": 0.3})],
        ...     over="tokens",
        ...     total=2_000_000_000,
        ... )
    """

    def __init__(
        self,
        phases: Sequence[tuple[float, Mapping | Sequence]] | Callable,
        *,
        over: str = "samples",
        total: int,
        interpolation: str = "linear",
    ):
        if over not in OVER:
            raise ValueError(f"`over` must be one of {OVER}, but is {over!r} instead.")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"`interpolation` must be one of {INTERPOLATIONS}, but is {interpolation!r} "
                "instead."
            )
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total <= 0:
            raise ValueError(f"`total` must be a positive integer, but is {total!r} instead.")
        self.over = over
        self.total = int(total)
        self.interpolation = interpolation
        self.function: Callable | None = None
        self.phases: list[Phase] = []
        if callable(phases):
            _check_picklable(phases)
            self.function = phases
        else:
            self.phases = _checked_phases(phases)

    def bind(self, names: list[str]) -> BoundSchedule:
        """This schedule over a mixture's sources (`names`, in the mixture's order).

        Raises:
            ValueError: a phase naming an unknown source or missing one of a sequence's
                weights, or weights without a positive sum at some point.
        """
        return BoundSchedule(self, names)

    def __repr__(self) -> str:
        if self.function is not None:
            shape = getattr(self.function, "__qualname__", type(self.function).__name__)
        else:
            shape = f"{len(self.phases)} phases"
        return f"Schedule({shape}, over={self.over!r}, total={self.total})"


class BoundSchedule:
    """A `Schedule` over a mixture's sources: weights as arrays, checked.

    `weights_at(progress)` gives, for progress in `over` units, float64 weights of shape
    `[P, S]` (P: points, S: sources), each row summing to 1.
    """

    def __init__(self, schedule: Schedule, names: list[str]):
        self.schedule = schedule
        self.names = list(names)
        self.over = schedule.over
        self.total = schedule.total
        self._points: np.ndarray | None = None
        self._table: np.ndarray | None = None
        if schedule.function is None:
            self._points = np.asarray([p.at for p in schedule.phases], np.float64) * self.total
            rows = [self._row(p.weights, f"the phase at {p.at}") for p in schedule.phases]
            self._table = np.stack(rows)
        else:
            self.weights_at(CHECK_GRID * self.total)  # refuses a bad function now, not mid-epoch

    def weights_at(self, progress) -> np.ndarray:
        """The normalised weights at each point of `progress` (in `over` units): `[P, S]`."""
        at = np.atleast_1d(np.asarray(progress, np.float64))
        if self._table is None:
            fraction = np.minimum(at / self.total, 1.0)
            return np.stack([self._row(self.schedule.function(float(f)), f) for f in fraction])
        phase = np.searchsorted(self._points, at, side="right") - 1
        phase = np.clip(phase, 0, len(self._points) - 1)
        if self.schedule.interpolation == "step" or len(self._points) == 1:
            return self._table[phase]
        following = np.minimum(phase + 1, len(self._points) - 1)
        span = self._points[following] - self._points[phase]
        share = np.zeros_like(at)
        moving = span > 0
        share[moving] = (at[moving] - self._points[phase][moving]) / span[moving]
        share = np.clip(share, 0.0, 1.0)[:, None]
        mixed = (1 - share) * self._table[phase] + share * self._table[following]
        return mixed / mixed.sum(axis=1, keepdims=True)

    def check_lengths(self, given: bool) -> None:
        """Refuses a schedule whose progress units the mixture's lengths do not match.

        Raises:
            ValueError: over tokens without lengths, or over samples with them.
        """
        if self.over == "tokens" and not given:
            raise ValueError(
                "A schedule over tokens needs each sample's length: pass `lengths=` (a token "
                "cache's `lengths`, one array per source), or build the schedule with "
                "over='samples'."
            )
        if self.over == "samples" and given:
            raise ValueError(
                "With `lengths=` the mixture counts its progress and shares in tokens: build the "
                "schedule with over='tokens' (its `total` in tokens), or leave out `lengths` to "
                "hold shares of samples."
            )

    def breakpoints(self) -> np.ndarray:
        """The phases' points in `over` units (none for a function)."""
        if self._points is None:
            return np.empty(0)
        return self._points

    def stepwise(self) -> bool:
        """Whether the weights hold from one phase's point to the next (a step schedule)."""
        return self._table is not None and self.schedule.interpolation == "step"

    def fingerprint(self) -> str:
        """A checksum of what shapes the weights (JSON-able, for a state's plan check)."""
        grid = self.weights_at(CHECK_GRID * self.total)
        head = json.dumps([self.over, self.total, self.schedule.interpolation, self.names])
        return f"{zlib.crc32(grid.tobytes(), zlib.crc32(head.encode())):08x}"

    def _row(self, weights, where) -> np.ndarray:
        """One point's weights as a normalised row over the mixture's sources."""
        if isinstance(weights, Mapping):
            unknown = sorted(str(k) for k in weights if str(k) not in self.names)
            if unknown:
                raise ValueError(
                    f"The schedule's weights at {where} name unknown source(s) {unknown}; the "
                    f"mixture's sources are {self.names}."
                )
            named = {str(k): v for k, v in weights.items()}
            weights = {name: named.get(name, 0.0) for name in self.names}
            values = dict.fromkeys(self.names, 0)
        else:
            values = list(range(len(self.names)))
        try:
            return parse_sources(values, weights, "the mixture's sources").weights
        except ValueError as error:
            raise ValueError(f"The schedule's weights at {where}: {error}") from None


def scheduled_sources(values, weights, what: str) -> tuple[WeightedSources, BoundSchedule | None]:
    """A mixture's sources with fixed weights, or with a `Schedule`'s (bound to their names; the
    weights given are the schedule's at progress 0).

    Raises:
        ValueError: as `parse_sources`, or as `Schedule.bind`.
    """
    if not isinstance(weights, Schedule):
        return parse_sources(values, weights, what), None
    sources = parse_sources(values, even_weights(values), what)
    bound = weights.bind(sources.names)
    return sources._replace(weights=bound.weights_at([0])[0]), bound


def _checked_phases(phases) -> list[Phase]:
    """`phases` as `Phase` records, refused when empty, out of order or not starting at 0."""
    out: list[Phase] = []
    for number, phase in enumerate(phases):
        try:
            at, weights = phase
            at = float(at)
        except (TypeError, ValueError):
            raise ValueError(
                f"The schedule's phase {number} must be an `(at, weights)` pair, but is "
                f"{phase!r} instead."
            ) from None
        if not 0.0 <= at <= 1.0:
            raise ValueError(
                f"The schedule's phase {number} is at {at}: `at` is a fraction of `total`, in "
                "[0, 1]."
            )
        if out and at <= out[-1].at:
            raise ValueError(
                f"The schedule's phases must be in increasing order of `at`, but phase "
                f"{number} is at {at} after one at {out[-1].at}."
            )
        out.append(Phase(at, weights))
    if not out:
        raise ValueError("A schedule needs at least one phase: `[(0.0, weights), ...]`.")
    if out[0].at != 0.0:
        raise ValueError(
            f"The schedule's first phase must be at 0 (the start of training), but is at "
            f"{out[0].at}."
        )
    return out


def _check_picklable(function: Callable) -> None:
    """Refuses a function the loader's workers or child process could not receive."""
    try:
        pickle.dumps(function)
    except Exception as error:
        raise ValueError(
            f"A schedule function must be picklable (the loader's workers receive it), but "
            f"{function!r} is not ({type(error).__name__}: {error}); define it at module level "
            "or use phases."
        ) from None
