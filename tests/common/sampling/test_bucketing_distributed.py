"""LengthBucketSampler and ShardedIterableDataset under torchrun (2 gloo processes, issue #11):
through `make_loader` with 2 workers per rank and an all-reduce per step, every rank takes the
same number of steps (no hang), every sample is read exactly once (besides the documented
padding), and a job stopped on 2 ranks resumes on 1 without losing or repeating a sample."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("dist_bucketing_script.py")
SHARDS = [13, 22, 30]


def _launch(folder, modes, ranks):
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
    kinds = (
        "bucket,sharded,mixture_batches" if ranks == 1 else "bucket,sharded,mixture,mixture_batches"
    )
    out = subprocess.run(
        [*launcher, str(SCRIPT), kinds, str(folder), modes],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]


pytestmark = pytest.mark.slow  # torchrun runs (a module fixture of 8 s): in the full suite (CI)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per world serves both tests: a whole epoch then 3 steps on 2 ranks, and the
    rest of that epoch on 1 rank."""
    folder = tmp_path_factory.mktemp("shards")
    start = 0
    for k, n in enumerate(SHARDS):
        (folder / f"s{k}.txt").write_text(" ".join(str(i) for i in range(start, start + n)))
        start += n
    for modes, ranks in (("epoch,stop", 2), ("resume", 1)):
        _launch(folder, modes, ranks)
    return folder


def _batches(folder, kind, mode):
    return json.loads((folder / kind / f"{mode}.json").read_text())["batches"]


def test_length_buckets_with_workers_under_torchrun_then_resumed_on_one_rank(runs):
    epoch = _batches(runs, "bucket", "epoch")
    plan = [tuple(b) for b in json.loads((runs / "bucket" / "plan.json").read_text())]
    assert len(epoch[0]) == len(epoch[1]) > 0  # equal steps: the all-reduce never waited on a rank
    # Exactly the plan (rank r takes batches r, r + 2, ...), padded by repeating its first batch
    # when the count is odd.
    padded = plan + plan[: len(plan) % 2]
    assert [tuple(b) for b in epoch[0]] == padded[0::2] and [tuple(b) for b in epoch[1]] == padded[
        1::2
    ]
    assert sorted(i for b in plan for i in b) == list(range(301))
    # Elastic: 3 steps on 2 ranks, then the rest of the epoch on 1 rank.
    stopped, rest = _batches(runs, "bucket", "stop"), _batches(runs, "bucket", "resume")
    done = [tuple(b) for rank in stopped for b in rank] + [tuple(b) for b in rest[0]]
    assert Counter(done) == Counter(plan)  # every planned batch once: none lost, none repeated


def test_sharded_dataset_with_workers_under_torchrun_then_resumed_on_one_rank(runs):
    epoch = _batches(runs, "sharded", "epoch")
    assert len(epoch[0]) == len(epoch[1]) > 0  # equal steps with 2 workers per rank
    samples = Counter(i for rank in epoch for b in rank for i in b)
    assert set(samples) == set(range(sum(SHARDS)))
    assert sum(samples.values()) - sum(SHARDS) <= 1  # at most world - 1 padding repeats
    stopped, rest = _batches(runs, "sharded", "stop"), _batches(runs, "sharded", "resume")
    done = Counter(i for rank in stopped for b in rank for i in b) + Counter(
        i for b in rest[0] for i in b
    )
    assert set(done) == set(range(sum(SHARDS)))  # nothing lost: the rest is what no rank received
    assert sum(done.values()) - sum(SHARDS) <= 1  # at most the padding of the first deal read twice


def test_mixtures_under_torchrun_then_resumed_on_one_rank(runs):
    """MixtureSampler on 2 ranks with 2 workers each (issue 23): disjoint, equal steps, every
    sample of the planned pass once (stop="drop_exhausted": every sample of both sources); the
    batch mode stopped on 2 ranks resumes on 1 with every planned batch once."""
    plan = json.loads((runs / "mixture" / "plan.json").read_text())
    assert sorted(plan) == list(range(301))
    epoch = _batches(runs, "mixture", "epoch")
    assert len(epoch[0]) == len(epoch[1]) > 0
    ranks = [[i for b in rank for i in b] for rank in epoch]
    padded = plan + plan[: (-len(plan)) % 2]
    assert ranks[0] == padded[0::2] and ranks[1] == padded[1::2]  # disjoint positions of one plan
    assert sum(Counter(ranks[0] + ranks[1]).values()) - 301 <= 1
    batch_plan = json.loads((runs / "mixture_batches" / "plan.json").read_text())
    batches = [tuple(batch_plan[i : i + 5]) for i in range(0, len(batch_plan), 5)]
    stopped, rest = (
        _batches(runs, "mixture_batches", "stop"),
        _batches(runs, "mixture_batches", "resume"),
    )
    done = [tuple(b) for rank in stopped for b in rank] + [tuple(b) for b in rest[0]]
    assert Counter(done) == Counter(batches)
