"""`recipes bench --plot DIR` (issue 32): each table's chart is a valid PNG and SVG whose data,
carried in the file, is the table that was printed: the same rows in the same order, the same
rates and ratios as printed."""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from recipes.bench.harness.bench_charts import Chart, read_chart, write_chart
from recipes.bench.harness.measure import measure, show_table
from recipes.cli import bench_commands, build_parser, main


def printed_tables(out: str) -> dict[str, list[list[str]]]:
    """The first Markdown table under each `## ` heading of `out`: its rows of cells."""
    tables, heading = {}, None
    for line in out.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            tables[heading] = []
        elif heading is not None and line.startswith("|"):
            if not re.fullmatch(r"\|[-:|]+\|", line):
                tables[heading].append([cell.strip() for cell in line.strip("|").split("|")])
        elif heading is not None and tables[heading]:
            heading = None  # the table ended: a later one without a heading is not charted
    return {h: rows[1:] for h, rows in tables.items() if rows}  # without the header row


def valid_files(folder: Path, name: str) -> Chart:
    """Both files of chart `name` are valid images carrying the same chart; returns it."""
    png, svg = folder / f"{name}.png", folder / f"{name}.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert read_chart(png) == read_chart(svg)
    return read_chart(png)


def assert_chart_is_table(
    chart: Chart,
    heading: str,
    cells: list[list[str]],
    value_format: str,
    value_col: int,
    ratio_col: int,
) -> None:
    assert chart.title == heading
    assert list(chart.names) == [row[0] for row in cells]
    assert [value_format.format(v) for v in chart.values] == [row[value_col] for row in cells]
    assert [chart.ratio_format.format(r) for r in chart.ratios()] == [
        row[ratio_col] for row in cells
    ]


def test_a_measured_tables_chart_is_the_printed_table(tmp_path, capsys):
    data = TensorDataset(torch.arange(512.0))
    rows = [
        measure(f"batches of {size}", DataLoader(data, batch_size=size)) for size in (4, 32, 128)
    ]
    heading = "toy: one epoch of 512 numbers, three batch sizes"
    show_table(heading, rows, unit="numbers/s", baseline=1, plot=tmp_path, name="toy")
    chart = valid_files(tmp_path, "toy")
    assert chart.baseline == 1 and chart.unit == "numbers/s"
    # format_table prints the rate as {:,.1f} in column 1 and the ratio in column 2
    assert_chart_is_table(
        chart, heading, printed_tables(capsys.readouterr().out)[heading], "{:,.1f}", 1, 2
    )


# 2 s: the chart-equals-table check runs in the fast tier above; this is the CLI's path
@pytest.mark.slow
def test_bench_common_plot_writes_its_table_as_a_chart(tmp_path, capsys):
    assert main(["bench", "common", "--paths", "20000", "--plot", str(tmp_path / "charts")]) == 0
    [(heading, cells)] = printed_tables(capsys.readouterr().out).items()
    chart = valid_files(tmp_path / "charts", "common-worker-memory")
    assert_chart_is_table(chart, heading, cells, "{:,.1f}", 1, 2)


def test_plot_goes_before_or_after_the_domain_and_through_a_bare_bench(tmp_path):
    parser = build_parser()
    for argv in (["bench", "--plot", "d", "nlp"], ["bench", "nlp", "--plot", "d"]):
        assert parser.parse_args(argv).plot == Path("d")
    assert parser.parse_args(["bench", "nlp"]).plot is None
    commands = bench_commands(Path("d"))
    assert len(commands) == len(bench_commands()) >= 7 and not any("train" in c for c in commands)
    assert all(c[-2:] == ["--plot", "d"] for c in commands)


def test_without_matplotlib_plot_fails_at_once_saying_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert (
        main(["bench", "common", "--paths", "1000000", "--plot", str(tmp_path)]) == 1
    )  # before measuring
    assert 'pip install "loader-recipes[plot]"' in capsys.readouterr().err
    with pytest.raises(ImportError, match=r'pip install "loader-recipes\[plot\]"'):
        write_chart(Chart("c", "t", "u", ("a",), (1.0,)), tmp_path)


def test_a_folder_that_takes_no_file_fails_before_measuring(tmp_path, capsys):
    """A folder the charts cannot be written to (here a path under a file, as an unwritable one
    would be) stops the benchmark before its minutes of measuring, naming the folder."""
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "charts"
    assert (
        main(["bench", "common", "--paths", "1000000", "--plot", str(folder)]) == 1
    )  # before measuring
    err = capsys.readouterr().err
    assert str(folder) in err and "cannot be written" in err


def test_a_chart_names_what_is_wrong_with_it(tmp_path):
    with pytest.raises(ValueError, match="one value per name"):
        write_chart(Chart("c", "t", "u", ("a", "b"), (1.0,)), tmp_path)
    with pytest.raises(ValueError, match="`baseline` must index"):
        write_chart(Chart("c", "t", "u", ("a",), (1.0,), baseline=2), tmp_path)
    Image.new("RGB", (4, 4)).save(tmp_path / "other.png")
    with pytest.raises(ValueError, match="carries no chart data"):
        read_chart(tmp_path / "other.png")


@pytest.mark.slow  # a real training run per loader (about 45 s on 2 cores)
def test_bench_train_plot_writes_the_tables_chart_and_each_runs_timeline(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes",
            "bench",
            "train",
            "--domain",
            "nlp",
            "--steps",
            "4",
            "--samples",
            "400",
            "--batch-size",
            "8",
            "--plot",
            str(tmp_path / "charts"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [(heading, cells)] = printed_tables(out.stdout).items()
    chart = valid_files(tmp_path / "charts", "train-nlp")
    alone = re.search(
        r"model alone \(batch resident on the device\): ([\d,.]+) tokens/s", out.stdout
    ).group(1)
    assert f"{chart.values[0]:,.1f}" == alone and chart.ratio_format == "{:.0%}"
    # the table's rows follow the model alone: rate in column 2, "of model alone" in column 3
    assert chart.title == heading and list(chart.names[1:]) == [row[0] for row in cells]
    assert [f"{v:,.1f}" for v in chart.values[1:]] == [row[2] for row in cells]
    assert [f"{r:.0%}" for r in chart.ratios()[1:]] == [row[3] for row in cells]
    timelines = sorted((tmp_path / "charts").glob("train-nlp-*-timeline.*"))
    assert len(timelines) == 2 * len(cells)
    for path in timelines:
        if path.suffix == ".png":
            with Image.open(path) as image:
                steps = json.loads(image.text["Description"])["timeline"]["steps"]
            assert steps == 5  # the first step, timed apart, and 4 steady ones
        else:
            assert ET.parse(path).getroot().tag == "{http://www.w3.org/2000/svg}svg"
