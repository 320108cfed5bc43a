"""ImageFolderFast under torchrun (2 gloo processes): disjoint ranks, full coverage, equal steps
with an all-reduce per step, and a different order per epoch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.testing import make_image_folder


# the vision template's two-rank run (fast tier) covers ImageFolderFast under torchrun
@pytest.mark.slow
def test_image_folder_with_distributed_sampler_under_torchrun(tmp_path):
    root = make_image_folder(tmp_path / "tree", classes=3, per_class=8, size=(120, 90), seed=4)
    script = Path(__file__).with_name("dist_image_folder_script.py")
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(root),
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(report.read_text()) == {
        "disjoint": True,
        "covered": True,
        "equal_steps": True,
        "reshuffled": True,
    }
