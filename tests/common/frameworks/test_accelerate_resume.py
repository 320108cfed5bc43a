"""`prepare_loader` (common/frameworks/accelerate_glue.py): a recipes loader under an
`accelerate.Accelerator`, saved and loaded by `save_state` / `load_state`.

The proof (slow tier): a tiny model trained by 2 torchrun processes (gloo, CPU) is stopped by a
crash right after a checkpoint in the middle of epoch 1, and a fresh launch resumes it; every
rank's batches, counted across the crash, are the uninterrupted run's in the same order, every
sample once per epoch over the ranks, and the final weights are the uninterrupted run's. The
fast tier holds the wrapper's own behaviour in one process: the state is the loop's place
though a batch is read ahead, the epoch's end reaches gradient accumulation, a loader not
split over the ranks is refused.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

accelerate = pytest.importorskip("accelerate")

from recipes.common import make_loader  # noqa: E402
from recipes.common.frameworks.accelerate_glue import (  # noqa: E402
    check_split,
    prepare_loader,
    read_loader_state,
    write_loader_state,
)

SCRIPT = Path(__file__).with_name("accelerate_resume_script.py")


@pytest.fixture
def accelerator():
    """A fresh single-process Accelerator (accelerate keeps its state in class-wide singletons)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _numbers(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _epochs(loader, epochs: int, stop: int | None = None, on_stop=None) -> list[list[int]]:
    """The batches a loop over `loader` receives, from its own epoch on; at `stop` batches,
    `on_stop()` and the loop ends."""
    seen = []
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for (batch,) in loader:
            seen.append(batch.tolist())
            if stop is not None and len(seen) == stop:
                on_stop()
                return seen
    return seen


def test_save_state_and_load_state_resume_the_loader_mid_epoch(accelerator, tmp_path):
    """In one process: saved by `save_state` in epoch 1, loaded by a new Accelerator's
    `load_state` into a new loader: the rest is the uninterrupted run's."""
    from accelerate.state import AcceleratorState, GradientState

    def fresh():
        torch.manual_seed(0)
        return make_loader(_numbers(), batch_size=4, shuffle=True, num_workers=0)

    whole = _epochs(prepare_loader(accelerator, fresh(), name="whole"), 3)
    first = prepare_loader(accelerator, fresh())
    head = _epochs(
        first, 3, stop=13, on_stop=lambda: accelerator.save_state(str(tmp_path / "ckpt"))
    )
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("recipes_loader-*"))
    assert saved == [
        "recipes_loader-train.rank0.json",
        "recipes_loader-whole.rank0.json",
    ]  # one per loader
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    again = accelerate.Accelerator(cpu=True)
    resumed = prepare_loader(again, fresh())
    again.load_state(str(tmp_path / "ckpt"))
    assert resumed.epoch == 1
    assert head + _epochs(resumed, 3) == whole


def test_the_state_is_the_loops_place_though_a_batch_is_read_ahead(accelerator):
    loader = prepare_loader(
        accelerator, make_loader(_numbers(), batch_size=4, shuffle=True, num_workers=0)
    )
    iterator = iter(loader)
    for taken in range(1, 4):
        next(iterator)
        assert (
            loader.state_dict()["batches_yielded"] == taken
        )  # the loader itself handed out one more
        assert loader.loader.state_dict()["batches_yielded"] == taken + 1
    del iterator  # a break: the epoch pauses where the loop was
    assert loader.state_dict()["batches_yielded"] == 3
    rest = [b.tolist() for (b,) in loader]  # iterating again after a break: the next epoch, whole
    assert len(rest) == 10 and loader.state_dict().get("finished_epoch") == 1


def test_set_epoch_after_a_break_moves_the_state_to_that_epoch(accelerator):
    sampler = DistributedSampler(_numbers(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = prepare_loader(
        accelerator, make_loader(_numbers(), batch_size=4, sampler=sampler, num_workers=0)
    )
    loader.set_epoch(0)
    for step, _ in enumerate(loader):
        if step == 2:
            break
    loader.set_epoch(1)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_yielded"]) == (1, 0) and loader.epoch == 1


def test_the_last_batch_of_an_epoch_steps_gradient_accumulation(accelerator, tmp_path):
    """accelerate's `accumulate()` steps at an epoch's end (`end_of_dataloader`), as with its
    own loaders: 5 batches, accumulation 2 -> syncs after batches 2, 4 and 5."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = prepare_loader(acc, make_loader(_numbers(20), batch_size=4, num_workers=0))
    synced = []
    for (batch,) in loader:
        with acc.accumulate(model):
            acc.backward(model(batch.float().unsqueeze(1)).mean())
            optimizer.step()
            optimizer.zero_grad()
            synced.append(acc.sync_gradients)
    assert synced == [False, True, False, True, True]


def test_a_loader_not_split_over_the_ranks_is_refused():
    dataset = _numbers()
    with pytest.raises(ValueError, match="whole dataset on every rank.*DistributedSampler"):
        check_split(make_loader(dataset, batch_size=4, shuffle=True, num_workers=0), 2, 0)
    split = make_loader(
        dataset,
        batch_size=4,
        num_workers=0,
        sampler=DistributedSampler(dataset, num_replicas=2, rank=1),
    )
    with pytest.raises(ValueError, match="rank 1 of 2, but this process is rank 0 of 2"):
        check_split(split, 2, 0)
    check_split(split, 2, 1)
    check_split(make_loader(dataset, batch_size=4, num_workers=0), 1, 0)  # one process reads all


def test_a_checkpoint_without_the_loaders_state_is_refused_naming_the_file(accelerator, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"recipes_loader-train\.rank0\.json"):
        read_loader_state(tmp_path, "train", rank=0, world_size=1)
    prepare_loader(accelerator, make_loader(_numbers(), batch_size=4, num_workers=0))
    with pytest.raises(ValueError, match="already prepared"):
        prepare_loader(accelerator, make_loader(_numbers(), batch_size=4, num_workers=0))


def test_each_rank_reads_its_own_state_and_another_world_reads_rank_0s(tmp_path):
    for rank in range(2):
        write_loader_state(tmp_path, "train", {"rank": rank}, rank=rank, world_size=2)
    assert [read_loader_state(tmp_path, "train", rank=r, world_size=2) for r in range(2)] == [
        {"rank": 0},
        {"rank": 1},
    ]
    assert read_loader_state(tmp_path, "train", rank=0, world_size=1) == {
        "rank": 0
    }  # elastic: rank 0's
    assert read_loader_state(tmp_path, "train", rank=2, world_size=3) == {"rank": 0}
    (tmp_path / "recipes_loader-train.rank1.json").unlink()
    with pytest.raises(FileNotFoundError, match="rank1.json is missing .* saved on 2 ranks"):
        read_loader_state(tmp_path, "train", rank=1, world_size=2)
    (tmp_path / "recipes_loader-train.rank0.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable loader state"):
        read_loader_state(tmp_path, "train", rank=0, world_size=2)


# ---- the proof: two processes, a crash in epoch 1, a fresh launch ---------------------------
def _launch(workdir: Path, kind: str, *extra: str, ranks: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            str(SCRIPT),
            str(workdir),
            kind,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _batches(workdir: Path, rank: int) -> list[tuple[int, list[int]]]:
    lines = (workdir / f"samples-rank{rank}.txt").read_text().split("\n")
    return [(int(line.split()[0]), [int(i) for i in line.split()[1:]]) for line in lines if line]


@pytest.mark.slow  # 3 torchrun launches of 2 processes per case: 30-50 s each on 2 cores
@pytest.mark.parametrize("kind, stop", [("workers", 18), ("bucket", 12)])  # both mid-epoch 1
def test_two_ranks_crashed_in_epoch_1_resume_exactly(kind, stop, tmp_path):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    whole.mkdir()
    crashed.mkdir()
    _launch(whole, kind)
    _launch(crashed, kind, "--stop-after", str(stop))
    before = [_batches(crashed, rank) for rank in range(2)]
    assert all(
        len(b) == stop and b[-1][0] == 1 for b in before
    )  # stopped mid-epoch 1, after a checkpoint
    _launch(crashed, kind)
    for rank in range(2):
        assert _batches(crashed, rank) == _batches(
            whole, rank
        )  # the same batches, in the same order
        assert (
            float((crashed / f"first-batch-rank{rank}.txt").read_text()) < 2.0
        )  # the resumed epoch's first
    for epoch in range(3):
        counts = collections.Counter(
            i
            for rank in range(2)
            for e, batch in _batches(crashed, rank)
            if e == epoch
            for i in batch
        )
        assert counts == collections.Counter(range(96)), (
            epoch
        )  # every sample once per epoch over the ranks
    assert json.loads((crashed / "weights.json").read_text()) == json.loads(
        (whole / "weights.json").read_text()
    )


@pytest.mark.slow  # 2 torchrun launches
@pytest.mark.parametrize("kind, ranks", [("elastic", 3), ("bucket", 1)])
def test_two_ranks_crashed_in_epoch_1_resume_on_another_number_of_ranks(kind, ranks, tmp_path):
    """Crashed on 2 ranks mid-epoch 1, resumed on 3 (make_loader's own sampler) or 1
    (LengthBucketSampler), each new rank reading rank 0's state: every sample of each epoch once
    over both runs, at most the new deal's padding repeated (samples, or whole batches)."""
    _launch(tmp_path, kind, "--stop-after", "18" if kind == "elastic" else "12")
    before = [_batches(tmp_path, rank) for rank in range(2)]
    for rank in range(2):
        (tmp_path / f"samples-rank{rank}.txt").rename(tmp_path / f"before-rank{rank}.txt")
    _launch(tmp_path, kind, ranks=ranks)
    after = [_batches(tmp_path, rank) for rank in range(ranks)]
    padding = ranks - 1 if kind == "elastic" else 0
    for epoch in range(3):
        counts = collections.Counter(
            i for seen in after for e, batch in seen if e == epoch for i in batch
        )
        counts += collections.Counter(
            i for seen in before for e, batch in seen if e == epoch for i in batch
        )
        assert set(counts) == set(range(96)) and sum(counts.values()) - 96 <= padding, (
            epoch,
            counts,
        )
