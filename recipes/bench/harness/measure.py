"""Measuring loaders: items/s and peak memory of the whole process tree, printed as a table.

Use when: comparing a recipe with its baseline in the same run (`recipes bench`). Ratios
against a baseline measured seconds earlier on the same machine are what transfer between
machines; absolute rates do not.
Cost: a sampling thread reading PSS of this process and its children every 200 ms (a
reading costs ~10 ms of CPU, so sampling faster would slow what it measures on 2 cores).
Adapt here: `count_items` for batches that are not a tensor or a tuple led by one.
Trade-off: PSS (proportional set size) splits shared pages fairly between processes, so a
memory map read by all workers counts once; polling can miss a spike shorter than 200 ms.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from recipes.bench.harness.bench_charts import chart_of_rows, slug, write_chart
from recipes.common.tuning.probes import PeakMemory, tree_memory_bytes  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Measurement:
    """One benchmark row: `items` in `seconds`, and the peak memory of the process tree.

    `items_per_s` is the steady-state rate: items after the first batch over the time after
    it, so worker start-up (`first_batch_seconds`, reported apart) does not dilute short runs.
    """

    name: str
    items: int
    seconds: float
    peak_bytes: int
    first_batch_seconds: float = 0.0
    first_batch_items: int = 0

    @property
    def items_per_s(self) -> float:
        steady_items = self.items - self.first_batch_items
        steady_seconds = self.seconds - self.first_batch_seconds
        if steady_items > 0 and steady_seconds > 0:
            return steady_items / steady_seconds
        if self.seconds > 0:
            return self.items / self.seconds
        return float("inf")

    @property
    def whole_epoch_per_s(self) -> float:
        """The rate over the whole epoch, first batch included (0 when nothing was timed)."""
        if self.seconds:
            return self.items / self.seconds
        return 0.0


def count_items(batch) -> int:
    """Samples in a batch: the first dimension of a tensor, or of a tuple/dict's first entry."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return len(batch)


def measure(
    name: str,
    batches: Iterable,
    *,
    counter: Callable[[object], int] = count_items,
    max_items: int | None = None,
) -> Measurement:
    """Iterates `batches` (a DataLoader) and times it; start-up is timed apart (first batch).

    The cyclic garbage collector is paused while it runs, as `timeit` does: in a process with a
    large heap (a test session, a notebook) a full collection landing on one row would time
    the harness, not the loader. Reference counting still frees every batch."""
    items = 0
    first_seconds = 0.0
    first_items = 0
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with PeakMemory() as memory:
            start = time.perf_counter()
            for batch in batches:
                items += counter(batch)
                if not first_items:
                    first_seconds = time.perf_counter() - start
                    first_items = items
                if max_items is not None and items >= max_items:
                    break
            seconds = time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()
    return Measurement(name, items, seconds, memory.peak, first_seconds, first_items)


def best_interleaved(*measurers, repeat: int = 5):
    """Best of `repeat` runs of each measurer, taken in turns: runs last ~0.1-1 s, so a burst of
    background work (another process, a loader's workers exiting) would otherwise land on one
    row and decide the comparison."""
    runs = [[] for _ in measurers]
    for _ in range(repeat):
        for results, measure_once in zip(runs, measurers, strict=True):
            results.append(measure_once())
    return [max(results, key=lambda m: m.items_per_s) for results in runs]


def format_table(
    rows: list[Measurement], *, unit: str = "items/s", baseline: int = 0, whole_epoch: bool = False
) -> str:
    """A Markdown table of the rows with each rate's ratio to `rows[baseline]`; with
    `whole_epoch`, also each row's rate over the whole epoch, first batch included."""
    base = rows[baseline].items_per_s
    whole_base = rows[baseline].whole_epoch_per_s
    extra = ""
    extra_align = ""
    if whole_epoch:
        extra = f" whole epoch {unit} | vs baseline |"
        extra_align = "---:|---:|"
    lines = [
        f"| loader | {unit} | vs baseline |{extra} first batch (s) | peak memory (MiB) |",
        "|---|---:|---:|" + extra_align + "---:|---:|",
    ]
    for row in rows:
        cells = ""
        if whole_epoch:
            whole = row.whole_epoch_per_s
            whole_ratio = 0.0
            if whole_base:
                whole_ratio = whole / whole_base
            cells = f" {whole:,.1f} | {whole_ratio:.2f}x |"
        lines.append(
            f"| {row.name} | {row.items_per_s:,.1f} | {row.items_per_s / base:.2f}x |{cells} "
            f"{row.first_batch_seconds:.2f} | {row.peak_bytes / 2**20:,.0f} |"
        )
    return "\n".join(lines)


def show_table(
    heading: str,
    rows: list[Measurement],
    *,
    unit: str = "items/s",
    baseline: int = 0,
    whole_epoch: bool = False,
    plot: Path | None = None,
    name: str | None = None,
) -> None:
    """Prints `## heading` and `format_table(rows, ...)`; with a `plot` folder, also writes the
    rows' rates as a bar chart there (`recipes.bench.harness.bench_charts`), named `name` (by
    default the heading's part before its colon)."""
    print(f"\n## {heading}\n")
    print(format_table(rows, unit=unit, baseline=baseline, whole_epoch=whole_epoch))
    if plot is not None:
        name = name or slug(heading.split(":")[0])
        write_chart(chart_of_rows(name, heading, rows, unit=unit, baseline=baseline), plot)


def peak_rss_growth(fn) -> int | None:
    """Bytes the process's resident set grew to, at its peak, while `fn()` ran.

    Resets the kernel's high-water mark (`/proc/self/clear_refs`, Linux >= 4.0), runs `fn`,
    and reads `VmHWM` against the RSS before; None where that interface is missing.
    """
    import psutil

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = psutil.Process().memory_info().rss
    fn()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return max(0, int(line.split()[1]) * 1024 - before)
    return None
