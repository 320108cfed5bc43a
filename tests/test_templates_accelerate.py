"""The Accelerate templates (`recipes template DOMAIN --framework accelerate`) run as printed
under torchrun (2 gloo processes: on CPUs `accelerate launch --cpu` starts one), and a run
crashed after 3 steps (`--stop-after 3`, an `os._exit` right after `accelerator.save_state`)
and launched again trains on the same samples, counted, as an uninterrupted one, on both ranks.
The nlp template also resumes on 1 rank a run crashed on 2 (LengthBucketSampler's global
position). All slow: each launch starts two processes that import torch, accelerate and the
domain (15-25 s here)."""

import collections
import contextlib
import io
import os
import subprocess
import sys

import pytest

from recipes.cli import main

pytest.importorskip("accelerate")
DOMAINS = ["vision", "nlp", "audio"]


def _script(domain, folder):
    printed = io.StringIO()
    with contextlib.redirect_stdout(
        printed
    ):  # as `recipes template DOMAIN --framework accelerate > train.py`
        assert main(["template", domain, "--framework", "accelerate"]) == 0
    path = folder / "train.py"
    path.write_text(
        printed.getvalue()
    )  # the user's copy: runs from their folder, not from this package
    return path


def _run(script, *args, ranks=2, timeout=300):
    launcher = (
        [sys.executable]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, str(script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=script.parent,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _samples(workdir, rank=None):
    """Every sample logged (by one rank, or by all), counted."""
    seen = collections.Counter()
    for log in workdir.glob("samples-rank*.txt" if rank is None else f"samples-rank{rank}.txt"):
        for line in log.read_text().split("\n"):
            seen.update(line.split())
    return seen


# 3-6 launches of 2 processes per domain: 0.5-3.5 minutes each on 2 cores (nlp the longest)
@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_a_crashed_accelerate_run_resumes_on_the_same_samples(domain, tmp_path):
    script = _script(domain, tmp_path)
    out = _run(script, "--workdir", "whole", "--log-samples")
    assert (
        "epoch 1:" in out and "| epoch |" in out
    )  # trained two epochs, reported the loader's health
    whole = [
        (tmp_path / "whole" / f"samples-rank{r}.txt").read_text().splitlines() for r in range(2)
    ]
    assert len(whole[0]) == len(whole[1]) > 3  # a line per step: equal steps on both ranks
    _run(script, "--workdir", "crashed", "--log-samples", "--stop-after", "3")
    assert sum(_samples(tmp_path / "crashed").values()) < sum(_samples(tmp_path / "whole").values())
    _run(
        script, "--workdir", "crashed", "--log-samples"
    )  # resumes from its newest complete checkpoint
    for rank in range(2):
        assert _samples(tmp_path / "crashed", rank) == _samples(tmp_path / "whole", rank)
    if (
        domain == "nlp"
    ):  # elastic: crashed on 2 ranks, resumed on 1 (rank 0's state, the global position)
        _run(script, "--workdir", "elastic", "--log-samples", "--stop-after", "3")
        _run(script, "--workdir", "elastic", "--log-samples", ranks=1)
        _run(
            script, "--workdir", "whole-1", "--log-samples", ranks=1
        )  # what one rank trains on, uninterrupted
        assert _samples(tmp_path / "elastic") == _samples(tmp_path / "whole-1")
