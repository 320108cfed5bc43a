"""The copy-and-adapt templates run as printed: with python, under torchrun (2 gloo processes),
and a killed-and-resumed run trains on the same samples as an uninterrupted one, also when it
resumes on fewer ranks (nlp: 2 -> 1). A template's uninterrupted run is launched once and
serves every test that compares against it. The fast tier runs the vision template under
torchrun and its two-rank resume; the other domains' torchrun runs and the one-rank resumes,
which repeat that launch path, are in the slow tier."""

import collections
import contextlib
import io
import os
import subprocess
import sys

import pytest

from recipes.cli import main

DOMAINS = ["vision", "nlp", "audio"]


def _script(domain, folder):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["template", domain]) == 0  # as `recipes template DOMAIN > train.py`, in-process
    path = folder / "train.py"
    path.write_text(printed.getvalue())  # the user's copy: runs from their folder, not from this package
    return path


def _run(script, *args, ranks=1, timeout=240):
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, str(script), "--smoke", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=script.parent, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _samples(workdir):
    seen = collections.Counter()
    for log in workdir.glob("samples-rank*.txt"):
        for line in log.read_text().split("\n"):
            seen.update(line.split())
    return seen


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """`whole(domain, ranks)`: (the template, its stdout) after an uninterrupted run in
    `<folder>/whole`, launched once per domain and rank count for the whole module."""
    done = {}

    def run(domain, ranks):
        if (domain, ranks) not in done:
            script = _script(domain, tmp_path_factory.mktemp(f"{domain}-{ranks}"))
            done[domain, ranks] = script, _run(script, "--workdir", "whole", "--log-samples", ranks=ranks)
        return done[domain, ranks]

    return run


@pytest.mark.slow  # a long run (6 s per domain) under torchrun; the killed-and-resumed vision template runs on 2 ranks in the fast tier
@pytest.mark.parametrize("domain", ["vision", "nlp", "audio"])
def test_template_smoke_under_torchrun(domain, whole):
    script, out = whole(domain, 2)
    assert "epoch 1:" in out
    steps = [len((script.parent / "whole" / f"samples-rank{r}.txt").read_text().splitlines()) for r in range(2)]
    assert steps[0] == steps[1] > 0  # a line per step: equal steps on both ranks (no DDP hang)


@pytest.mark.parametrize("domain, ranks", [pytest.param("vision", 2, marks=pytest.mark.slow)]  # 22 s: full suite
                         + [pytest.param(d, 1, marks=pytest.mark.slow) for d in DOMAINS])
def test_killed_and_resumed_run_sees_the_same_samples(domain, ranks, whole):
    script, out = whole(domain, ranks)
    folder = script.parent
    assert "epoch 1:" in out and "| epoch |" in out  # trained two epochs, reported the loader's health
    _run(script, "--workdir", "crashed", "--log-samples", "--stop-after", "3", ranks=ranks)
    assert sum(_samples(folder / "crashed").values()) < sum(_samples(folder / "whole").values())
    _run(script, "--workdir", "crashed", "--log-samples", ranks=ranks)  # resumes from its checkpoint
    assert _samples(folder / "crashed") == _samples(folder / "whole")
    if domain == "nlp":  # elastic: crashed on 2 ranks, resumed on 1 (LengthBucketSampler's global position)
        _run(script, "--workdir", "elastic", "--log-samples", "--stop-after", "3", ranks=2)
        _run(script, "--workdir", "elastic", "--log-samples", ranks=1)
        assert _samples(folder / "elastic") == _samples(folder / "whole")


def test_the_nlp_template_mixes_two_corpora(tmp_path, capsys):
    """`--mix` (issue 23): a second corpus at its weight, mixed then bucketed; the monitor's
    realised shares are printed per epoch and follow the weight."""
    import re

    from recipes.nlp.template import main

    main(["--smoke", "--mix", "--mix-weight", "0.4", "--workdir", str(tmp_path), "--epochs", "2"])
    out = capsys.readouterr().out
    shares = [float(x) / 100 for x in re.findall(r"mix (\d+)%", out)]
    assert len(shares) == 2 and all(abs(s - 0.4) < 0.12 for s in shares), out
    assert (tmp_path / "tokens").is_dir() and (tmp_path / "tokens-mix").is_dir()


@pytest.mark.slow  # a long run (11 s); the loaders' epoch-boundary resumes are tested in the fast tier (test_resume_repros.py, test_thread_loader.py)
def test_a_crash_at_an_epochs_last_step_resumes(tmp_path, zygote):
    """The checkpoint saved at an epoch's last step resumes an epoch with no batch left: the
    run finishes (it stopped with an unbound `loss` before, at every rerun)."""
    import torch

    code = "import sys\nfrom recipes.nlp.template import main\nmain(sys.argv[1:])\n"
    args = ["--smoke", "--mix", "--workdir", str(tmp_path)]
    full = zygote.python(code, *args)
    assert full.wait(timeout=240) == 0, full.stderr
    last_step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]  # the last epoch's last step
    (tmp_path / "checkpoint.pt").unlink()
    crashed = zygote.python(code, *args, "--stop-after", str(last_step))
    assert crashed.wait(timeout=240) == 0, crashed.stderr
    resumed = zygote.python(code, *args)
    assert resumed.wait(timeout=240) == 0, resumed.stderr
    assert "loss -" in resumed.stdout  # the resumed epoch had no batch left
