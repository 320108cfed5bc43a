"""`recipes/bench/frameworks/lightning_loop.py` runs and prints its two tables (slow tier: short
Lightning runs, 10-20 s on 2 cores); a resumed run's first batch, ours and in Lightning, comes in
under 2 s at every position, and the baseline reads its way there."""

import argparse
import re

import pytest


@pytest.mark.slow  # 8 short Lightning fits and 3 resumes (~40 s)
def test_the_lightning_bench_prints_the_loops_and_the_waits(capsys):
    pytest.importorskip("lightning")
    from recipes.bench.frameworks import lightning_loop

    parser = argparse.ArgumentParser()
    lightning_loop.add_arguments(parser)
    args = parser.parse_args(
        [
            "--samples",
            "512",
            "--resume-samples",
            "1024",
            "--item-us",
            "300",
            "--batch-size",
            "16",
            "--epochs",
            "2",
            "--repeat",
            "1",
        ]
    )
    assert lightning_loop.run(args) == 0
    out = capsys.readouterr().out
    assert (
        "| plain loop (our for-loop) |" in out
        and "| Lightning loop (LoaderDataModule, Trainer.fit) |" in out
    )
    ratio = re.search(r"\| ratio \(Lightning / plain\)[^|]*\| ([0-9.]+) ", out)
    assert ratio and 0.3 < float(ratio.group(1)) < 3, out
    waits = {
        label: [float(x) for x in re.findall(r"\| ([0-9.]+)", row)]
        for label, row in re.findall(r"\| (ours[^|]*|skip by iterating[^|]*)(\|.*)", out)
    }
    assert len(waits) == 3 and all(len(w) == 3 for w in waits.values()), out
    for label, row in waits.items():
        if label.startswith("ours"):
            assert max(row) < 2.0, (label, row)
    baseline = next(w for label, w in waits.items() if label.startswith("skip"))
    assert baseline[2] > baseline[0]  # reading 60 batches of 4.8 ms before the one asked for
