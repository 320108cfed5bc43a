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


def _run(kind, folder, mode, ranks):
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(ranks)]
    out = subprocess.run([*launcher, str(SCRIPT), kind, str(folder), mode], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((folder / f"{mode}.json").read_text())["batches"]


@pytest.fixture
def shards(tmp_path):
    start = 0
    for k, n in enumerate(SHARDS):
        (tmp_path / f"s{k}.txt").write_text(" ".join(str(i) for i in range(start, start + n)))
        start += n
    return tmp_path


def test_length_buckets_with_workers_under_torchrun_then_resumed_on_one_rank(shards):
    epoch = _run("bucket", shards, "epoch", 2)
    plan = [tuple(b) for b in json.loads((shards / "plan.json").read_text())]
    assert len(epoch[0]) == len(epoch[1]) > 0  # equal steps: the all-reduce never waited on a rank
    # Exactly the plan (rank r takes batches r, r + 2, ...), padded by repeating its first batch
    # when the count is odd.
    padded = plan + plan[: len(plan) % 2]
    assert [tuple(b) for b in epoch[0]] == padded[0::2] and [tuple(b) for b in epoch[1]] == padded[1::2]
    assert sorted(i for b in plan for i in b) == list(range(301))
    # Elastic: 3 steps on 2 ranks, then the rest of the epoch on 1 rank.
    stopped = _run("bucket", shards, "stop", 2)
    rest = _run("bucket", shards, "resume", 1)
    done = [tuple(b) for rank in stopped for b in rank] + [tuple(b) for b in rest[0]]
    assert Counter(done) == Counter(plan)  # every planned batch once: none lost, none repeated


def test_sharded_dataset_with_workers_under_torchrun_then_resumed_on_one_rank(shards):
    epoch = _run("sharded", shards, "epoch", 2)
    assert len(epoch[0]) == len(epoch[1]) > 0  # equal steps with 2 workers per rank
    samples = Counter(i for rank in epoch for b in rank for i in b)
    assert set(samples) == set(range(sum(SHARDS)))
    assert sum(samples.values()) - sum(SHARDS) <= 1  # at most world - 1 padding repeats
    stopped = _run("sharded", shards, "stop", 2)
    rest = _run("sharded", shards, "resume", 1)
    done = Counter(i for rank in stopped for b in rank for i in b) + Counter(i for b in rest[0] for i in b)
    assert done == samples  # the same epoch: nothing lost, nothing read twice
