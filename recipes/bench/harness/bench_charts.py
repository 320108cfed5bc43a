"""`recipes bench --plot DIR`: each benchmark table as a bar chart, `DIR/<name>.png` and `.svg`.

Use when: showing a table's result at a glance (the docs' Benchmarks page): one horizontal bar
per row, in the table's order, the baseline grey, each bar's rate and its ratio to the
baseline printed at its end, the table's heading as the title.
Cost: matplotlib imported once (about 0.5 s) and two small files written per table.
Adapt here: `Chart` (what one table hands over) and `_draw` (colours, sizes).
Trade-off: one column per table, the one its ratios are taken on (steady-state rate); a
table's other columns (first batch, memory, whole epoch) stay in the printed table. Each file
carries the chart's data as JSON in its Description (`read_chart`), so what is drawn can be
checked against what was printed.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from recipes.common.tuning.monitor_plot import import_pyplot, save_figure


@dataclass(frozen=True)
class Chart:
    """One table as bars: `names` and `values` are its rows in order, in `unit`; the ratios
    divide by `values[baseline]` and print with `ratio_format`. `name` is the files' stem."""

    name: str
    title: str
    unit: str
    names: tuple[str, ...]
    values: tuple[float, ...]
    baseline: int = 0
    ratio_format: str = "{:.2f}x"

    def ratios(self) -> list[float]:
        base = self.values[self.baseline]
        return [value / base if base else float("nan") for value in self.values]


def chart_of_rows(name: str, title: str, rows: Sequence, *, unit: str, baseline: int = 0) -> Chart:
    """The chart of `measure`'s rows: each row's `items_per_s`, as `format_table` prints it."""
    return Chart(
        name, title, unit, tuple(r.name for r in rows), tuple(r.items_per_s for r in rows), baseline
    )


def slug(text: str, limit: int = 64) -> str:
    """A file stem from `text`: lower case, runs of other characters as one hyphen, cut at a
    hyphen to at most `limit` characters."""
    stem = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if len(stem) > limit:
        head = stem[: limit + 1]
        if "-" in head:  # at the last hyphen that keeps it within the limit
            stem = head.rsplit("-", 1)[0]
        else:
            stem = stem[:limit]
    return stem or "table"


def prepare(folder: Path | None) -> None:
    """Checks before a benchmark runs that its charts can be written: matplotlib imports, and
    `folder` exists or can be made and takes a file (nothing when `folder` is None).

    Raises:
        ImportError: no matplotlib (`pip install "loader-recipes[plot]"`).
        OSError: `folder` cannot be made or written, naming it.
    """
    if folder is None:
        return
    import tempfile

    import_pyplot()
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".recipes-plot-check-"):
            pass
    except OSError as error:
        raise OSError(
            f"--plot {folder}: charts cannot be written there ({error}); pass a writable folder"
        ) from None


def write_chart(chart: Chart, folder: Path | str | None) -> list[Path]:
    """Draws `chart` to `folder/<chart.name>.png` and `.svg`; returns the paths ([] without a
    folder).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: a chart without rows or a baseline outside them.
    """
    if folder is None:
        return []
    if not chart.names or len(chart.names) != len(chart.values):
        raise ValueError(
            f"Chart {chart.name!r} needs one value per name, but has {len(chart.names)} names and "
            f"{len(chart.values)} values."
        )
    if not 0 <= chart.baseline < len(chart.values):
        raise ValueError(
            f"`baseline` must index a row of chart {chart.name!r}, but is {chart.baseline} instead."
        )

    plt = import_pyplot()
    fig = _draw(plt, chart)
    paths = [Path(folder) / f"{chart.name}{suffix}" for suffix in (".png", ".svg")]
    for path in paths:
        save_figure(fig, path, {"chart": asdict(chart)})
    plt.close(fig)
    return paths


def _draw(plt, chart: Chart):
    rows = len(chart.values)
    fig, axes = plt.subplots(figsize=(10, 1.4 + 0.55 * rows), layout="constrained")
    colours = ["#9a9a9a" if i == chart.baseline else "#4c72b0" for i in range(rows)]
    bars = axes.barh(range(rows), chart.values, color=colours, height=0.6)
    axes.set_yticks(range(rows), [textwrap.fill(n, 44) for n in chart.names], fontsize="small")
    axes.invert_yaxis()  # the table's first row on top
    axes.set_xlabel(chart.unit)
    axes.xaxis.set_major_formatter(
        lambda value, _: _number(value)
    )  # 2,000,000 rather than 2.0 and "1e6"
    right = 1
    if max(chart.values) > 0:  # room for the notes beside the longest bar
        right = max(chart.values) * 1.3
    axes.set_xlim(0, right)
    for bar, value, ratio, i in zip(bars, chart.values, chart.ratios(), range(rows), strict=True):
        note = "baseline" if i == chart.baseline else chart.ratio_format.format(ratio)
        axes.annotate(
            f" {_number(value)}  ({note})",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize="small",
        )
    axes.set_title(textwrap.fill(chart.title, 100), fontsize="medium", loc="left")
    axes.spines[["top", "right"]].set_visible(False)
    return fig


def _number(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def read_chart(path: Path | str) -> Chart:
    """The chart data a `write_chart` file carries (PNG or SVG).

    Raises:
        ValueError: the file carries no chart data.
    """
    path = Path(path)
    if path.suffix.lower() == ".svg":
        import xml.etree.ElementTree as ET

        node = ET.parse(path).find(".//{http://purl.org/dc/elements/1.1/}description")
        text = None
        if node is not None:
            text = node.text
    else:
        from PIL import Image

        with Image.open(path) as image:
            text = image.text.get("Description")
    payload = {}
    if text:
        payload = json.loads(text)
    if "chart" not in payload:
        raise ValueError(
            f"{path} carries no chart data (no JSON `chart` in its Description); write it with "
            "write_chart."
        )
    data = payload["chart"]
    return Chart(**{**data, "names": tuple(data["names"]), "values": tuple(data["values"])})
