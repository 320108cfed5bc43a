"""`recipes bench train` runs end to end on CPU (a tiny model per domain; the GPU figures come
from the same code on a GPU machine)."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # every domain end to end; each domain's loaders have their own fast tests
def test_bench_train_smoke_every_domain(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes",
            "bench",
            "train",
            "--domain",
            "all",
            "--steps",
            "3",
            "--images",
            "64",
            "--samples",
            "400",
            "--batch-size",
            "8",
            "--json",
            str(tmp_path / "train.json"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for domain in ("vision", "nlp", "audio", "lm"):
        assert f"## train/{domain}: tiny on cpu" in out.stdout
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["device"] == "cpu" and result["steps"] == 3
    expected_rows = {"vision": 6, "nlp": 2, "audio": 3, "lm": 2}
    for domain, count in expected_rows.items():
        rows = result[domain]["rows"]
        assert len(rows) == count and result[domain]["model_alone"] > 0
        for row in rows:
            assert row["steps"] == 4  # the first step, timed apart, and 3 steady ones
            assert row["rate"] > 0 and 0.0 <= row["wait_fraction"] <= 1.0
            assert abs(row["of_model"] - row["rate"] / result[domain]["model_alone"]) < 1e-9
            assert row["first_batch_s"] > 0
    names = [row["name"] for row in result["vision"]["rows"]]
    assert (
        "plain" in names[0]
        and "cold" in names[1]
        and "warm" in names[2]
        and "DeviceCropLoader" in names[5]
    )
    assert "path='threads'" in names[3] and "path='isolated'" in names[4]
    names = [row["name"] for row in result["lm"]["rows"]]
    assert "LengthBucketSampler" in names[0] and "packed_loader" in names[1]
