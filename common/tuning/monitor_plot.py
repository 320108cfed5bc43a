"""The timeline of a `LoaderMonitor` run: each step's data wait and compute, and the loader's
memory, recorded in bounded arrays (`StepTimeline`) and drawn as one chart (`plot_timeline`).

Use when: a summary says the loop waits for data and you want to see how: a starved
accelerator bounces between busy and idle at every step, a slow worker shows as a periodic
spike, a leak as a climbing memory line. `monitor.plot("timeline.png")` draws it.
Cost: recording is a few numpy element writes per step into fixed arrays (`max_rows` rows of
three float64s: 1.5 MiB at the default 65,536); past that, neighbouring rows merge pairwise, so a
run of any length keeps at most `max_rows` rows, each covering `stride` consecutive steps
(a million steps: 65,536 rows of 16 steps). Drawing imports matplotlib (about 0.5 s) only then.
Adapt here: `max_rows`, and `plot_timeline`'s `x` ("time": wall seconds, the width of each
step is its duration; "step": the step index).
Trade-off: a merged row shows the mean of its steps, so a single slow step in a long run is
diluted; the memory line is the monitor's readings (at most one per `sample_seconds`), not a
continuous trace. Step time is what the CPU sees (see `LoaderMonitor`).
Copy with: nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_ROWS = 65_536
MAX_READINGS = 4_096


class StepTimeline:
    """Per-step data wait and compute, and memory readings, in bounded numpy arrays.

    A step opens when its batch arrives (`open`, with the wait) and closes when the loop asks
    for the next one (`close`, with the compute in between). Rows hold `stride` steps each
    (the last row may hold fewer); when the arrays fill, pairs of rows merge and `stride`
    doubles. Memory readings keep at most `max_readings`, dropping every other one when full.
    """

    def __init__(self, max_rows: int = MAX_ROWS, max_readings: int = MAX_READINGS):
        for name, value in (("max_rows", max_rows), ("max_readings", max_readings)):
            if value < 2 or value % 2:
                raise ValueError(
                    f"`{name}` must be an even number of at least 2, but is {value!r} instead."
                )
        self.start = np.zeros(max_rows)  # seconds from the first request to the row's first request
        self.wait = np.zeros(max_rows)  # summed over the row's steps
        self.compute = np.zeros(max_rows)
        self.rows = self.steps = 0
        self.stride = 1
        self.memory = np.zeros((max_readings, 3))  # seconds, main RSS bytes, workers' USS bytes
        self.readings = 0
        self.epoch_starts: list[int] = []  # the step index at which each epoch began
        self.origin: float | None = None
        self._in_row = 0
        self._open = False
        self._got = 0.0
        self._epoch: int | None = None

    def open(self, asked: float, got: float, epoch: int) -> None:
        """A batch asked for at `asked` arrived at `got` (`time.perf_counter` seconds)."""
        if self.origin is None:
            self.origin = asked
        if epoch != self._epoch:
            self._epoch = epoch
            self.epoch_starts.append(self.steps)
        if self.rows == 0 or self._in_row >= self.stride:
            if self.rows == len(self.start):
                self._merge()
            self.start[self.rows] = asked - self.origin
            self.wait[self.rows] = self.compute[self.rows] = 0.0
            self.rows += 1
            self._in_row = 0
        self.wait[self.rows - 1] += got - asked
        self._got = got
        self._in_row += 1
        self.steps += 1
        self._open = True

    def close(self, compute: float) -> None:
        """The open step's compute took `compute` seconds; nothing when no step is open."""
        if self._open:
            self.compute[self.rows - 1] += compute
            self._open = False

    def end(self) -> None:
        """Closes a step still open at the end of an epoch (a loop that broke out after its
        step): its compute lasted until now."""
        self.close(time.perf_counter() - self._got)

    def read_memory(self, main_bytes: int, workers_bytes: int) -> None:
        """One memory reading, timed now."""
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now
        if self.readings == len(self.memory):
            kept = self.memory[::2].copy()
            self.memory[: len(kept)] = kept
            self.readings = len(kept)
        self.memory[self.readings] = (now - self.origin, main_bytes, workers_bytes)
        self.readings += 1

    def _merge(self) -> None:
        half = len(self.start) // 2
        self.start[:half] = self.start[0::2]
        for values in (self.wait, self.compute):
            values[:half] = values[0::2] + values[1::2]
        self.rows = half
        self.stride = self.stride * 2
        self._in_row = self.stride  # the merged last row is full: the next step starts a row

    def data(self) -> TimelineData:
        """The recorded rows as per-step means, and the memory readings (copies)."""
        counts = np.full(self.rows, self.stride, dtype=np.int64)
        if self.rows:
            counts[-1] = self._in_row
        return TimelineData(
            start_s=self.start[: self.rows].copy(),
            steps=counts,
            wait_s=self.wait[: self.rows] / np.maximum(counts, 1),
            compute_s=self.compute[: self.rows] / np.maximum(counts, 1),
            memory=self.memory[: self.readings].copy(),
            epoch_starts=list(self.epoch_starts),
        )


@dataclass
class TimelineData:
    """What `plot_timeline` draws. Rows: `start_s` (seconds from the first request), `steps`
    (steps the row covers), `wait_s` and `compute_s` (per step, the mean over the row);
    `memory` is `[R, 3]`: seconds, main RSS bytes, workers' USS bytes; `epoch_starts` are step
    indices."""

    start_s: np.ndarray
    steps: np.ndarray
    wait_s: np.ndarray
    compute_s: np.ndarray
    memory: np.ndarray
    epoch_starts: list[int]

    def totals(self) -> dict[str, float]:
        """Steps and summed seconds: what the chart's metadata carries."""
        return {
            "steps": int(self.steps.sum()),
            "wait_s": float((self.wait_s * self.steps).sum()),
            "compute_s": float((self.compute_s * self.steps).sum()),
            "rows": len(self.steps),
        }


def import_pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or an ImportError that says how to install
    it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            'Plotting needs matplotlib: pip install "loader-recipes[plot]"'
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(
    timeline: StepTimeline, path: str | Path, *, x: str = "time", title: str | None = None
) -> TimelineData:
    """Draws `timeline` to `path` (.png or .svg, by its suffix) and returns the data drawn.

    Top: each step's compute and data wait stacked (ms), with main and worker memory (MiB) on a
    second axis. Bottom: the share of each step spent computing, the "busy" of an accelerator
    fed by this loop: a starved one bounces between near 0 and 100%.

    Raises:
        ValueError: an unknown suffix or `x`, or a timeline without steps.
        ImportError: matplotlib is not installed.
    """
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"`path` must end in .png or .svg, but is {str(path)!r} instead.")
    if x not in ("time", "step"):
        raise ValueError(f"`x` must be 'time' or 'step', but is {x!r} instead.")
    data = timeline.data()
    if not len(data.steps):
        raise ValueError("The timeline has no steps yet: iterate the monitor before plotting it.")
    plt = import_pyplot()
    first_step = np.concatenate([[0], np.cumsum(data.steps)[:-1]])
    busy = (
        np.divide(
            data.compute_s,
            data.compute_s + data.wait_s,
            out=np.zeros_like(data.compute_s),
            where=data.compute_s + data.wait_s > 0,
        )
        * 100
    )
    if x == "time":  # each step from its start to its end, then nothing until the next one starts
        ends = (
            data.start_s + (data.wait_s + data.compute_s) * data.steps
        )  # (a gap between epochs is no step's)
        xs = np.column_stack([data.start_s, ends]).ravel()
        gaps = np.zeros_like(data.compute_s)
        compute_ms = np.column_stack([data.compute_s, gaps]).ravel() * 1e3
        wait_ms = np.column_stack([data.wait_s, gaps]).ravel() * 1e3
        busy_line = np.column_stack([busy, np.full_like(busy, np.nan)]).ravel()
    else:
        xs = np.append(first_step, data.steps.sum())
        compute_ms = np.append(data.compute_s, 0) * 1e3
        wait_ms = np.append(data.wait_s, 0) * 1e3
        busy_line = np.append(busy, busy[-1])
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 5.5), height_ratios=[3, 1], layout="constrained"
    )
    top.fill_between(xs, 0, compute_ms, step="post", color="#4c72b0", label="compute", linewidth=0)
    top.fill_between(
        xs,
        compute_ms,
        compute_ms + wait_ms,
        step="post",
        color="#dd8452",
        label="data wait",
        linewidth=0,
    )
    top.set_ylabel("ms per step")
    _draw_memory(top, data, None if x == "time" else first_step)
    bottom.step(xs, busy_line, where="post", color="#4c72b0", linewidth=0.8)
    bottom.set_ylim(-5, 105)
    bottom.set_ylabel("busy %")
    bottom.set_xlabel("seconds since the first batch was asked for" if x == "time" else "step")
    for step in data.epoch_starts[1:]:
        at = step
        if x == "time":
            row = np.searchsorted(first_step, step, side="right") - 1
            at = data.start_s[min(row, len(data.start_s) - 1)]
        for axes in (top, bottom):
            axes.axvline(at, color="grey", linestyle=":", linewidth=0.8)
    totals = data.totals()
    share = 0
    if totals["wait_s"] + totals["compute_s"]:
        share = totals["wait_s"] / (totals["wait_s"] + totals["compute_s"])
    stride = f", {data.steps[0]} steps per point" if data.steps[0] > 1 else ""
    stats = (
        f"{totals['steps']:,} steps; data wait {share:.0%} of wait + compute, "
        f"the first step included{stride}"
    )
    if title:
        stats = f"{title}\n{stats}"
    top.set_title(stats, fontsize="medium", loc="left")
    save_figure(fig, path, {"timeline": totals})
    plt.close(fig)
    return data


def _draw_memory(axes, data: TimelineData, first_step: np.ndarray | None) -> None:
    """Main RSS and workers' USS on a second y axis: against time, or with `first_step` (each
    row's first step) against the row whose first request came last before each reading."""
    if not len(data.memory):
        axes.figure.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
        return
    seconds, main, workers = data.memory.T
    where = seconds
    if first_step is not None:
        rows = np.searchsorted(data.start_s, seconds, side="right") - 1
        where = first_step[np.clip(rows, 0, len(data.steps) - 1)]
    twin = axes.twinx()
    twin.plot(where, main / 2**20, color="#55a868", marker=".", label="main RSS (MiB)")
    if workers.any():
        twin.plot(where, workers / 2**20, color="#c44e52", marker=".", label="workers USS (MiB)")
    twin.set_ylabel("MiB")
    twin.set_ylim(0, max(main.max(), workers.max()) / 2**20 * 1.15 or 1)
    handles = axes.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    axes.figure.legend(
        handles=handles,
        loc="outside lower center",
        ncols=len(handles),
        fontsize="small",
        frameon=False,
    )


def save_figure(fig, path: Path, payload: dict) -> None:
    """Saves `fig` to `path` (format from the suffix) with `payload` as JSON in the file's
    Description (a PNG tEXt chunk, the SVG's Dublin Core metadata), so a reader can check what
    was drawn; SVG text stays text."""
    import matplotlib

    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "recipes"}):
        fig.savefig(path, metadata={"Description": json.dumps(payload)}, dpi=100)
