"""A mixture's realised share of each source against its target, over sliding windows of an
epoch's plan, and their plot over a run (issue 48: a mixture that moves is seen at a glance).

Use when: checking that a `MixtureSampler` holds its weights (fixed, a `Schedule`, or set by the
loop with `set_weights`) through an epoch or a run: `share_trace(mix)` (or `mix.share_trace()`)
gives, at points along the mixture's progress, the share of each source in the last `window`
units (tokens with `lengths=`, else samples) of the plan, in samples and in tokens, beside the
weights in force over that window; `plot_shares([...])` draws the traces of several epochs.
Cost: one pass over the epoch's plan (a cumulative sum per source: O(N x S) time, O(N) memory)
and the weights at `GRID` points per window; drawing imports matplotlib (about 0.5 s) only then.
Adapt here: `WINDOW`, `POINTS`, `GRID`.
Trade-off: the trace reads the plan over all ranks (what the mixture drew, in order), not the
batches one rank received: `LoaderMonitor`'s `sources` and `sources_tokens` are those. A window
counts the samples that end inside it, whole: a window of a few samples' length is coarse.
Copy with: common/sampling/mixture_plan.py, common/sampling/mixture_weights.py,
  common/sampling/pacing/mixture_epoch.py, common/sampling/pacing/mixture_pacing.py,
  common/sampling/pacing/mixture_schedule.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from recipes.common.sampling.pacing.mixture_epoch import EpochDraws

WINDOW = 65_536  # units (tokens with lengths, else samples) per window
POINTS = 200  # windows per epoch, their ends evenly spaced over its progress
GRID = 33  # points of progress per window where the target weights are averaged
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


class ShareTrace(NamedTuple):
    """Realised and target shares of each source at points of a mixture's progress.

    Shapes: `[P]` or `[P, S]` (P: points, the end of each window; S: sources, in `names`' order).
    """

    progress: np.ndarray
    """`[P]` the mixture's progress (units planned since epoch 0) at each window's end."""
    samples: np.ndarray
    """`[P, S]` each source's share of the window's samples."""
    tokens: np.ndarray | None
    """`[P, S]` each source's share of the window's tokens; None without lengths."""
    target: np.ndarray
    """`[P, S]` the weights in force over the window, averaged over its progress."""
    names: list[str]
    """The sources' names."""


def share_trace(
    mixture, epoch: int | None = None, *, window: int = WINDOW, points: int = POINTS
) -> ShareTrace:
    """The realised shares of `mixture`'s plan of `epoch` (its current epoch when None) in
    sliding windows of `window` units, against the weights in force (a segment's weights set by
    the loop, else the schedule's at the progress, else the fixed weights).

    Args:
        mixture: a `MixtureSampler`.
        epoch: the epoch whose plan is read (from `mixture.known_from(epoch)`).
        window: units per window: tokens when the mixture has `lengths`, else samples (cut to
            the epoch's length).
        points: windows, their ends evenly spaced from the first whole window to the epoch's
            end (fewer when the epoch has fewer distinct ends).

    Returns:
        A `ShareTrace`; empty (P = 0) for an empty epoch.

    Raises:
        ValueError: a non-positive `window` or `points`.
    """
    for name, value in (("window", window), ("points", points)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer, but is {value!r} instead.")
    # the epoch's draws: the sampler's own room (mixture_epoch.py), read, not changed
    draws: EpochDraws = mixture._epoch(epoch)
    sources = draws.source_of(draws.indices)
    units = np.ones(len(sources), np.int64)
    if mixture.lengths is not None:
        units = np.asarray(mixture.lengths, np.int64)[draws.indices]
    ends = np.cumsum(units)  # each sample's end, in units from the known part's start
    total = int(ends[-1]) if len(ends) else 0
    count = len(mixture.names)
    if total == 0:
        empty = np.zeros((0, count))
        tokens = None
        if mixture.lengths is not None:
            tokens = empty
        return ShareTrace(np.zeros(0), empty, tokens, empty, list(mixture.names))
    width = min(int(window), total)
    at = np.unique(np.linspace(width, total, min(int(points), total - width + 1)).round())
    upto = np.searchsorted(ends, at, side="right")  # samples ending by each window's end
    since = np.searchsorted(ends, at - width, side="right")  # ... and by its start
    samples = _shares(sources, np.ones_like(units), since, upto, count)
    tokens = None
    if mixture.lengths is not None:
        tokens = _shares(sources, units, since, upto, count)
    start = draws.segments[0].progress
    target = _target(mixture, draws, ends, at - width, width)
    return ShareTrace(start + at, samples, tokens, target, list(mixture.names))


def _shares(sources, units, since, upto, count: int) -> np.ndarray:
    """`[P, S]` each source's share of `units` among samples `since[p]:upto[p]` (one cumulative
    sum per source: O(N) memory at a time, not O(N x S))."""
    inside = np.zeros((len(since), count), np.float64)
    for source in range(count):
        cumulative = np.concatenate([[0], np.cumsum(np.where(sources == source, units, 0))])
        inside[:, source] = cumulative[upto] - cumulative[since]
    whole = inside.sum(axis=1, keepdims=True)
    return np.divide(inside, whole, out=np.zeros_like(inside), where=whole > 0)


def _target(mixture, draws: EpochDraws, ends, starts, width: int) -> np.ndarray:
    """`[P, S]` the weights in force averaged over `GRID` points of each window (in units from
    the known part's start): at each, the weights of the segment that drew the sample holding
    it (set by the loop), else the schedule's at its progress, else the fixed weights."""
    offsets = (np.arange(GRID) + 0.5) / GRID * width  # the middles of GRID equal parts
    grid = (starts[:, None] + offsets[None, :]).ravel()
    # the sample at each grid point, and the segment that drew it
    position = draws.first + np.minimum(np.searchsorted(ends, grid, side="right"), len(ends) - 1)
    segment_starts = np.asarray([s.start for s in draws.segments])
    holding = np.searchsorted(segment_starts, position, side="right") - 1
    weights = np.tile(np.asarray(mixture.weights, np.float64), (len(grid), 1))
    if mixture.schedule is not None:
        weights = mixture.schedule.weights_at(draws.segments[0].progress + grid)
    for number, segment in enumerate(draws.segments):
        if segment.weights is not None:
            weights[holding == number] = np.asarray(segment.weights, np.float64)
    return weights.reshape(len(starts), GRID, -1).mean(axis=1)


def joined(traces: list[ShareTrace]) -> ShareTrace:
    """Several epochs' traces as one along progress; a trace whose progress restarts (fixed
    weights count no progress across epochs) is placed after the one before."""
    if not traces:
        raise ValueError("`traces` is empty: pass the `share_trace` of at least one epoch.")
    progress = []
    shift = 0.0
    for trace in traces:
        moved = np.asarray(trace.progress, np.float64)
        if progress and len(moved) and moved[0] + shift <= progress[-1][-1]:
            shift = progress[-1][-1]
        progress.append(moved + shift)
    tokens = None
    if all(t.tokens is not None for t in traces):
        tokens = np.concatenate([t.tokens for t in traces])
    return ShareTrace(
        np.concatenate(progress),
        np.concatenate([t.samples for t in traces]),
        tokens,
        np.concatenate([t.target for t in traces]),
        list(traces[0].names),
    )


def plot_shares(
    traces: list[ShareTrace] | ShareTrace, path: str | Path, *, title: str | None = None
) -> ShareTrace:
    """Draws each source's realised share (solid: tokens with lengths, else samples) against
    its target (dashed) over a run, the epochs' traces joined along progress, to `path` (.png or
    .svg, by its suffix); returns the data drawn (the joined trace).

    Raises:
        ValueError: an unknown suffix, or no points to draw.
        ImportError: matplotlib is not installed.
    """
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"`path` must end in .png or .svg, but is {str(path)!r} instead.")
    if isinstance(traces, ShareTrace):
        traces = [traces]
    data = joined(list(traces))
    if not len(data.progress):
        raise ValueError("The traces have no points: an empty epoch has nothing to draw.")
    plt = _pyplot()
    realised = data.samples
    unit = "samples"
    if data.tokens is not None:
        realised = data.tokens
        unit = "tokens"
    fig, axes = plt.subplots(figsize=(10, 4), layout="constrained")
    for number, name in enumerate(data.names):
        color = COLORS[number % len(COLORS)]
        axes.plot(data.progress, realised[:, number], color=color, label=f"{name} (realised)")
        axes.plot(data.progress, data.target[:, number], color=color, linestyle="--")
    axes.set_xlabel(f"progress ({unit} planned since epoch 0)")
    axes.set_ylabel(f"share of {unit}")
    axes.set_ylim(0, 1)
    heading = f"realised (solid) against target (dashed) shares of {unit}"
    if title:
        heading = f"{title}\n{heading}"
    axes.set_title(heading, fontsize="medium", loc="left")
    axes.legend(loc="upper right", fontsize="small")
    payload = {"names": data.names, "points": len(data.progress), "unit": unit}
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Description": json.dumps(payload)}, dpi=100)
    plt.close(fig)
    return data


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or an ImportError that says how to
    install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            'Plotting needs matplotlib: pip install "loader-recipes[plot]"'
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
