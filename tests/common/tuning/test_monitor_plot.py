"""`LoaderMonitor.plot` and its bounded `StepTimeline` (issue 32): each step's wait and compute as
the loop lived them, a record that stays bounded over any run, and image files that carry the
figures they draw."""

import json
import subprocess
import sys
import time
import warnings
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from recipes.common import LoaderMonitor
from recipes.common.tuning.monitor_plot import StepTimeline

FETCH, STEP = 0.02, 0.01


class Fetching(Dataset):
    """Items that take FETCH seconds each to make, in the loop's own process."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        time.sleep(FETCH)
        return i


def _description(path):
    if path.suffix == ".svg":
        root = ET.parse(path).getroot()  # parses as XML, or raises
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        return json.loads(root.find(".//{http://purl.org/dc/elements/1.1/}description").text)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 300 and image.size[1] > 200
        return json.loads(image.text["Description"])


def test_the_timeline_holds_each_steps_wait_and_compute_and_the_chart_carries_them(tmp_path):
    monitor = LoaderMonitor(DataLoader(Fetching(), batch_size=None), sample_seconds=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loop is starved on purpose
        for _ in range(2):
            for _batch in monitor:
                time.sleep(STEP)
    data = monitor.timeline.data()
    # every step recorded apart, as the loop lived it: each wait at least the fetch's sleep,
    # each compute at least the step's (the upper bounds leave room for a busy machine)
    assert data.steps.tolist() == [1] * 12 and data.epoch_starts == [0, 6]
    assert np.all((data.wait_s >= FETCH) & (data.wait_s < FETCH + 0.2))
    assert np.all((data.compute_s >= STEP) & (data.compute_s < STEP + 0.2))
    assert np.all(np.diff(data.start_s) >= FETCH + STEP)
    # the same figures as the epochs' own totals
    epochs_wait = sum(e["wait_s"] for e in monitor.epochs)
    assert data.totals()["wait_s"] == pytest.approx(epochs_wait, rel=1e-9)
    assert data.totals()["compute_s"] == pytest.approx(
        sum(e["step_s"] for e in monitor.epochs), abs=1e-3
    )
    assert len(data.memory) >= 2 and np.all(data.memory[:, 1] > 0)  # a reading per epoch at least
    for name in ("timeline.png", "timeline.svg"):
        drawn = monitor.plot(tmp_path / name, x="step" if name.endswith("svg") else "time")
        assert (
            _description(tmp_path / name) == {"timeline": drawn.totals()}
            and drawn.totals() == data.totals()
        )


def test_a_loop_that_breaks_out_closes_its_last_step():
    monitor = LoaderMonitor(DataLoader(Fetching(), batch_size=None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starved on purpose
        for i, _batch in enumerate(monitor):
            time.sleep(STEP)
            if i == 2:
                break
    data = monitor.timeline.data()
    assert data.steps.sum() == 3 and np.all(data.compute_s >= STEP)


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(0, 3000), half_rows=st.integers(1, 64), readings=st.integers(0, 300))
def test_the_timeline_stays_bounded_and_keeps_every_steps_time(steps, half_rows, readings):
    timeline = StepTimeline(max_rows=2 * half_rows, max_readings=8)
    clock = 0.0
    for i in range(steps):
        wait, compute = 0.001 * (i % 7), 0.002 * (i % 5)
        timeline.open(clock, clock + wait, epoch=i // 1000)
        timeline.close(compute)
        clock += wait + compute
    for i in range(readings):
        timeline.read_memory(i, 2 * i)
    data = timeline.data()
    assert len(data.steps) <= 2 * half_rows and timeline.readings <= 8
    assert data.steps.sum() == steps and data.epoch_starts == list(range(0, steps, 1000))
    assert np.all(data.steps[:-1] == timeline.stride) if steps else len(data.steps) == 0
    expected_wait = sum(0.001 * (i % 7) for i in range(steps))
    expected_compute = sum(0.002 * (i % 5) for i in range(steps))
    assert data.totals()["wait_s"] == pytest.approx(expected_wait, abs=1e-9)
    assert data.totals()["compute_s"] == pytest.approx(expected_compute, abs=1e-9)
    assert len(data.memory) >= min(
        readings, 5
    )  # a full buffer thins to half, then takes the new one
    if readings:
        assert (
            data.memory[-1, 1] == readings - 1 and data.memory[0, 1] == 0
        )  # the newest and the first kept
        assert np.all(np.diff(data.memory[:, 1]) > 0)


def test_bad_arguments_say_what_to_pass(tmp_path):
    monitor = LoaderMonitor([1, 2])
    with pytest.raises(ValueError, match="no steps yet"):
        monitor.plot(tmp_path / "t.png")
    list(monitor)
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        monitor.plot(tmp_path / "t.jpg")
    with pytest.raises(ValueError, match="'time' or 'step'"):
        monitor.plot(tmp_path / "t.png", x="epoch")
    with pytest.raises(ValueError, match="even number"):
        StepTimeline(max_rows=3)


def test_without_matplotlib_plot_says_how_to_install_it(tmp_path, monkeypatch):
    monitor = LoaderMonitor([1, 2])
    list(monitor)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(
        ImportError, match=r'^Plotting needs matplotlib: pip install "loader-recipes\[plot\]"$'
    ):
        monitor.plot(tmp_path / "t.png")


@pytest.mark.slow  # 5-9 s: a fresh interpreter importing every domain
def test_importing_recipes_and_its_cli_imports_no_matplotlib():
    probe = (
        "import sys\nimport recipes, recipes.common, recipes.vision, recipes.nlp, recipes.audio\n"
        "import recipes.common.tuning.monitor, recipes.bench.harness.bench_charts\n"
        "from recipes.cli import build_parser\nbuild_parser()\nprint('matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
