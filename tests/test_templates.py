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
        assert (
            main(["template", domain]) == 0
        )  # as `recipes template DOMAIN > train.py`, in-process
    path = folder / "train.py"
    path.write_text(
        printed.getvalue()
    )  # the user's copy: runs from their folder, not from this package
    return path


def _run(script, *args, ranks=1, timeout=240):
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
            done[domain, ranks] = (
                script,
                _run(script, "--workdir", "whole", "--log-samples", ranks=ranks),
            )
        return done[domain, ranks]

    return run


# a long run (6 s per domain) under torchrun; the killed-and-resumed vision template runs on 2 ranks
# in the fast tier
@pytest.mark.slow
@pytest.mark.parametrize("domain", ["vision", "nlp", "audio"])
def test_template_smoke_under_torchrun(domain, whole):
    script, out = whole(domain, 2)
    assert "epoch 1:" in out
    steps = [
        len((script.parent / "whole" / f"samples-rank{r}.txt").read_text().splitlines())
        for r in range(2)
    ]
    assert steps[0] == steps[1] > 0  # a line per step: equal steps on both ranks (no DDP hang)


@pytest.mark.parametrize(
    "domain, ranks",
    [pytest.param("vision", 2, marks=pytest.mark.slow)]  # 22 s: full suite
    + [pytest.param(d, 1, marks=pytest.mark.slow) for d in DOMAINS],
)
def test_killed_and_resumed_run_sees_the_same_samples(domain, ranks, whole):
    script, out = whole(domain, ranks)
    folder = script.parent
    assert (
        "epoch 1:" in out and "| epoch |" in out
    )  # trained two epochs, reported the loader's health
    _run(script, "--workdir", "crashed", "--log-samples", "--stop-after", "3", ranks=ranks)
    assert sum(_samples(folder / "crashed").values()) < sum(_samples(folder / "whole").values())
    _run(
        script, "--workdir", "crashed", "--log-samples", ranks=ranks
    )  # resumes from its checkpoint
    assert _samples(folder / "crashed") == _samples(folder / "whole")
    if (
        domain == "nlp"
    ):  # elastic: crashed on 2 ranks, resumed on 1 (LengthBucketSampler's global position)
        _run(script, "--workdir", "elastic", "--log-samples", "--stop-after", "3", ranks=2)
        _run(script, "--workdir", "elastic", "--log-samples", ranks=1)
        assert _samples(folder / "elastic") == _samples(folder / "whole")


# 8-17 s (two tokenizer trainings, two caches, two epochs); mixtures are tested in the fast tier
# (test_mixture.py)
@pytest.mark.slow
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


# a long run (11 s); the loaders' epoch-boundary resumes are tested in the fast tier
# (test_resume_repros.py, test_thread_loader.py)
@pytest.mark.slow
def test_a_crash_at_an_epochs_last_step_resumes(tmp_path, zygote):
    """The checkpoint saved at an epoch's last step resumes an epoch with no batch left: the
    run finishes (it stopped with an unbound `loss` before, at every rerun)."""
    import torch

    code = "import sys\nfrom recipes.nlp.template import main\nmain(sys.argv[1:])\n"
    args = ["--smoke", "--mix", "--workdir", str(tmp_path)]
    full = zygote.python(code, *args)
    assert full.wait(timeout=240) == 0, full.stderr
    last_step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)[
        "step"
    ]  # the last epoch's last step
    (tmp_path / "checkpoint.pt").unlink()
    crashed = zygote.python(code, *args, "--stop-after", str(last_step))
    assert crashed.wait(timeout=240) == 0, crashed.stderr
    resumed = zygote.python(code, *args)
    assert resumed.wait(timeout=240) == 0, resumed.stderr
    assert "loss -" in resumed.stdout  # the resumed epoch had no batch left


# ---- the Lightning templates (`recipes template DOMAIN --framework lightning`, issue 31) ----
# Each runs as printed, and a killed run resumed from Lightning's checkpoint (with OneCycleLR,
# Lightning #20550's trigger) trains on the same samples as an uninterrupted one: in one process
# for every domain (forked from an interpreter that imported Lightning: 7-15 s saved per run),
# and on 2 ranks under torchrun for nlp (LengthBucketSampler, use_distributed_sampler=False).


def test_the_framework_option_prints_that_frameworks_template():
    for framework, module in (("plain", "template"), ("lightning", "template_lightning")):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["template", "nlp", "--framework", framework]) == 0
        from pathlib import Path

        import recipes.nlp

        assert (
            printed.getvalue() == (Path(recipes.nlp.__file__).parent / f"{module}.py").read_text()
        )


@pytest.fixture(scope="module")
def lightning_zygote():
    pytest.importorskip("lightning")
    from tests.zygote import Zygote

    server = Zygote(
        [
            "numpy",
            "torch",
            "recipes.common",
            "recipes.vision",
            "recipes.nlp",
            "recipes.audio",
            "transformers",
            "lightning.pytorch",
        ]
    )
    yield server
    server.close()


def _lightning_script(domain, folder):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["template", domain, "--framework", "lightning"]) == 0
    path = folder / "train.py"
    path.write_text(printed.getvalue())
    return path


def _run_forked(zygote, script, *args):
    child = zygote.python(
        script.read_text(), "--smoke", *args, cwd=script.parent, env={"OMP_NUM_THREADS": "1"}
    )
    assert child.wait(timeout=240) == 0, child.stdout[-2000:] + child.stderr[-3000:]
    return child.stdout


@pytest.mark.slow  # 3 Lightning runs per domain (5-10 s each, forked)
@pytest.mark.parametrize("domain", DOMAINS)
def test_a_killed_lightning_run_resumes_on_the_same_samples(domain, lightning_zygote, tmp_path):
    script = _lightning_script(domain, tmp_path)
    out = _run_forked(lightning_zygote, script, "--workdir", "whole", "--log-samples")
    assert "epoch 1:" in out and "trained to epoch 2" in out
    _run_forked(
        lightning_zygote, script, "--workdir", "crashed", "--log-samples", "--stop-after", "3"
    )
    assert (
        0
        < sum(_samples(tmp_path / "crashed").values())
        < sum(_samples(tmp_path / "whole").values())
    )
    _run_forked(
        lightning_zygote, script, "--workdir", "crashed", "--log-samples"
    )  # resumes from its checkpoint
    assert _samples(tmp_path / "crashed") == _samples(tmp_path / "whole")
    whole = (tmp_path / "whole" / "samples-rank0.txt").read_text()
    assert (
        whole == (tmp_path / "crashed" / "samples-rank0.txt").read_text()
    )  # and in the same order


@pytest.mark.slow  # 3 launches of 2 Lightning processes under torchrun (~30 s each)
def test_a_killed_lightning_run_on_two_ranks_resumes_on_the_same_samples(tmp_path):
    script = _lightning_script("nlp", tmp_path)
    _run(script, "--workdir", "whole", "--log-samples", ranks=2)
    steps = [
        len((tmp_path / "whole" / f"samples-rank{r}.txt").read_text().splitlines())
        for r in range(2)
    ]
    assert steps[0] == steps[1] > 3  # equal steps on both ranks (no DDP hang)
    _run(script, "--workdir", "crashed", "--log-samples", "--stop-after", "3", ranks=2)
    _run(script, "--workdir", "crashed", "--log-samples", ranks=2)
    for rank in range(2):
        name = f"samples-rank{rank}.txt"
        assert (tmp_path / "crashed" / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert _samples(tmp_path / "crashed") == _samples(tmp_path / "whole")
