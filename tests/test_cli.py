import json
import subprocess
import sys

import pytest

from recipes.cli import main
from recipes.commands.doctor import build_report, format_report
from recipes.common import Resources
from recipes.common.sizing.resources import GiB


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "recipes", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_the_subcommands():
    out = _cli("--help")
    assert out.returncode == 0
    for command in ("doctor", "bench"):
        assert command in out.stdout


def test_help_and_errors_do_not_import_torch():
    probe = (
        "import sys\nfrom recipes.cli import main\ntry:\n    main(['--help'])\nexcept "
        "SystemExit:\n    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch', "
        "file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "no torch", out.stderr


def test_doctor_prints_a_report(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in (
        "CPUs",
        "memory",
        "/dev/shm",
        "ulimit -n",
        "GPUs",
        "torch",
        "production",
        "sharing strategy",
    ):
        assert word in out


def test_doctor_json_parses_and_matches_detection(tmp_path, capsys):
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "memory.max").write_text(str(3 * GiB))
    (tmp_path / "memory.current").write_text(str(GiB))
    assert main(["doctor", "--json", "--cgroup-root", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cpus"]["effective"] == 1 and report["cpus"]["cgroup_quota"] == 1.0
    assert report["memory"]["cgroup_limit_bytes"] == 3 * GiB
    assert report["memory"]["effective_available_bytes"] <= 2 * GiB
    assert set(report["profiles"]) == {
        "debug",
        "production",
        "memory",
        "throughput",
        "text",
        "auto",
    }
    assert report["profiles"]["debug"]["settings"]["num_workers"] == 0
    assert report["versions"]["torch"]
    assert report["multiprocessing"]["sharing_strategy"] in ("file_descriptor", "file_system")


@pytest.mark.parametrize(
    "args", [["frobnicate"], ["doctor", "--bogus"], ["bench", "nosuchdomain"], []]
)
def test_bad_commands_exit_non_zero_with_one_line(args):
    out = _cli(*args)
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "error" in out.stderr


def _res(**kw):
    base = dict(
        cpus=8,
        cpus_logical=8,
        memory_available=32 * GiB,
        memory_limit=None,
        shm_bytes=8 * GiB,
        shm_free=8 * GiB,
        gpus=1,
        nofile_limit=65536,
    )
    return Resources(**{**base, **kw})


def _problems(report):
    return " ".join(w["problem"] + " " + w["fix"] for w in report["warnings"])


def test_doctor_warns_about_docker_shm():
    text = _problems(
        build_report(_res(shm_bytes=64 * 2**20), local_world_size=1, cuda_available=False)
    )
    assert "/dev/shm is 64 MiB" in text and "--shm-size=8g or --ipc=host" in text


def test_doctor_warns_about_low_ulimit_and_many_workers_and_memory():
    report = build_report(
        _res(nofile_limit=1024, memory_available=4 * GiB),
        planned_workers=24,
        sample_bytes=8 * 2**20,
        local_world_size=1,
        cuda_available=False,
    )
    text = _problems(report)
    assert "ulimit -n is 1024" in text
    assert "24 workers" in text
    assert "over the loader budget" in text
    assert "! " in format_report(report)


def test_doctor_is_quiet_on_a_healthy_machine():
    assert build_report(_res(), local_world_size=1, cuda_available=False)["warnings"] == []


@pytest.mark.slow  # 3-6 s
def test_bench_common_runs_and_prints_a_ratio(capsys):
    assert main(["bench", "common", "--paths", "200000"]) == 0
    out = capsys.readouterr().out
    assert "PackedStrings" in out and "vs baseline" in out


TUNE_FACTORY = """
import time
import torch
from torch.utils.data import Dataset

class Busy(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        end = time.perf_counter() + 0.004
        while time.perf_counter() < end:
            pass
        return torch.tensor([i])

def make():
    return Busy()
"""


@pytest.mark.slow  # 8 s of measuring
def test_tune_prints_the_table_and_writes_json(tmp_path):
    (tmp_path / "mydata.py").write_text(TUNE_FACTORY)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes",
            "tune",
            "mydata:make",
            "--batch-size",
            "8",
            "--seconds-per-trial",
            "0.2",
            "--max-workers",
            "1",
            "--memory-budget",
            "64G",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "| workers | prefetch | samples/s |" in out.stdout
        and "make_loader(dataset, **{" in out.stdout
    )
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["settings"]["batch_size"] == 8 and result["settings"]["num_workers"] in (0, 1)
    assert {t["num_workers"] for t in result["trials"]} >= {0, 1}


def test_tune_names_a_bad_factory(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "recipes", "tune", "nothing_here"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode != 0 and "MODULE:NAME" in out.stderr


TUNE_WITH_STEP = """
import time
import torch

class Held:  # thread-batched records, each batch 4 ms of Python
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return self.read_batch([i], None)
    def thread_batches(self):
        return True
    def read_batch(self, indices, rng):
        end = time.thread_time() + 0.004
        while time.thread_time() < end:
            pass
        return {"ids": torch.tensor(indices)}
    def __repr__(self):
        return "Held()"

def make():
    return Held()

def step(batch):  # 12 ms of Python: the GIL held
    end = time.thread_time() + 0.012
    while time.thread_time() < end:
        pass
"""


@pytest.mark.slow  # 6 s of measuring
def test_tune_with_the_real_step_measures_the_thread_paths_and_stores_the_path(tmp_path):
    (tmp_path / "mine.py").write_text(TUNE_WITH_STEP)
    env = {**__import__("os").environ, "RECIPES_TUNE_DIR": str(tmp_path / "tune")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes",
            "tune",
            "mine:make",
            "--batch-size",
            "8",
            "--step",
            "mine:step",
            "--seconds-per-trial",
            "0.3",
            "--max-workers",
            "1",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "| threads |" in out.stdout
        and "| isolated |" in out.stdout
        and "step mine:step" in out.stdout
    )
    result = json.loads((tmp_path / "out.json").read_text())
    assert (
        result["settings"]["path"] in ("threads", "isolated", "workers")
        and result["trials"][0]["kept"] > 0
    )
    (stored,) = (tmp_path / "tune").glob("*.json")
    record = json.loads(stored.read_text())
    assert record["settings"] == result["settings"] and record["step"] == "the step step()"
    both = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes",
            "tune",
            "mine:make",
            "--step",
            "mine:step",
            "--step-ms",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert both.returncode != 0 and "not allowed with argument" in both.stderr
