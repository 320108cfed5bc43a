"""`LoaderTrainerMixin` (common/frameworks/hf_trainer_glue.py): `transformers.Trainer` trained
from a recipes loader, resumed from its checkpoint exactly and at once.

The proof: a tiny model trained by 2 torchrun processes (gloo, CPU) is stopped by a crash right
after a checkpoint in the middle of epoch 1, and a fresh launch resumes it
(`train(resume_from_checkpoint=True)`); every rank's batches, counted across the crash, are the
uninterrupted run's in the same order, every sample once per epoch over the ranks, and the
final weights are the uninterrupted run's. In one process: gradient accumulation (2 batches
per step), and an iterable dataset under `max_steps` (the Trainer numbers its epochs from 0
again after a resume; the loader's are kept). All slow: importing the Trainer alone takes
8-20 s here.
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
from torch.utils.data import Dataset, DistributedSampler

pytest.importorskip("accelerate")
SCRIPT = Path(__file__).with_name("hf_trainer_resume_script.py")
N = 96


def _launch(workdir: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SCRIPT),
            str(workdir),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _lines(path: Path) -> list[list[int]]:
    return [[int(i) for i in line.split()] for line in path.read_text().split("\n") if line]


@pytest.mark.slow  # 3 torchrun launches of 2 processes: 50-90 s on 2 cores
def test_two_ranks_crashed_in_epoch_1_resume_exactly(tmp_path):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    whole.mkdir()
    crashed.mkdir()
    _launch(whole)
    _launch(crashed, "--stop-at", "15")  # epoch 1 is steps 13-24 (12 batches per rank per epoch)
    assert [len(_lines(crashed / f"samples-rank{r}.txt")) for r in range(2)] == [15, 15]
    assert (crashed / "out" / "checkpoint-15" / "recipes_loader-train.rank1.json").is_file()
    _launch(crashed)
    for rank in range(2):
        assert _lines(crashed / f"samples-rank{rank}.txt") == _lines(
            whole / f"samples-rank{rank}.txt"
        )
        assert (
            float((crashed / f"first-batch-rank{rank}.txt").read_text()) < 2.0
        )  # no skipping by reading
    batches = [_lines(crashed / f"samples-rank{rank}.txt") for rank in range(2)]
    for epoch in range(3):
        counts = collections.Counter(
            i
            for rank in range(2)
            for batch in batches[rank][12 * epoch : 12 * (epoch + 1)]
            for i in batch
        )
        assert counts == collections.Counter(range(N)), (
            epoch
        )  # every sample once per epoch over the ranks
    assert json.loads((crashed / "weights.json").read_text()) == json.loads(
        (whole / "weights.json").read_text()
    )


# ---- one process, in this one: a stop (should_training_stop) after a checkpoint, a new Trainer --
class _Items(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {
            "x": torch.tensor([i / N, (i % 7) / 7]),
            "labels": torch.tensor([float(i % 3)]),
            "idx": i,
        }


def _read_shard(name: str, start: int = 0, stop: int | None = None):
    first = 12 * int(name)
    for i in range(first + start, first + (12 if stop is None else stop)):
        yield {
            "x": torch.tensor([i / N, (i % 7) / 7]),
            "labels": torch.tensor([float(i % 3)]),
            "idx": i,
        }


def _train(
    output: Path, loader, *, stop_at: int | None = None, resume: bool = False, **training
) -> tuple:
    """(the idx of every batch trained on, the final weights) of a Trainer run from `loader`."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from recipes.common.frameworks.hf_trainer_glue import LoaderTrainerMixin

    hf_logging.set_verbosity_error()
    seen: list[list[int]] = []

    class LoaderTrainer(LoaderTrainerMixin, Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs["idx"].tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x, labels, idx=None):
            return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}

    torch.manual_seed(0)
    model = Tiny()
    args = TrainingArguments(
        output_dir=str(output),
        save_steps=3,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        learning_rate=0.05,
        seed=0,
        disable_tqdm=True,
        **training,
    )
    trainer = LoaderTrainer(model=model, args=args, train_loader=loader, callbacks=[Stop()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    return seen, {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.mark.slow  # the Trainer's import (8-20 s) and 3 runs of 2-3 s
def test_gradient_accumulation_resumes_exactly(tmp_path):
    from recipes.common import make_loader

    def loader():
        sampler = DistributedSampler(_Items(), num_replicas=1, rank=0, shuffle=True, seed=0)
        return make_loader(_Items(), batch_size=4, sampler=sampler, num_workers=0)

    training = {
        "num_train_epochs": 3,
        "gradient_accumulation_steps": 2,
    }  # 24 batches, 12 steps per epoch
    whole, final = _train(tmp_path / "whole", loader(), **training)
    head, _ = _train(tmp_path / "crashed", loader(), stop_at=18, **training)  # mid-epoch 1
    assert len(head) == 36
    rest, resumed = _train(tmp_path / "crashed", loader(), resume=True, **training)
    assert head + rest == whole and resumed == final


@pytest.mark.slow  # 3 runs of 1-6 s (and the Trainer's import when first)
def test_an_iterable_dataset_under_max_steps_keeps_the_loaders_epochs(tmp_path):
    """Without a length the Trainer counts its epochs from 0 again after a resume; the loader
    goes on in its own (a `ShardedIterableDataset` reshuffles its shards every epoch)."""
    from recipes.common import ShardedIterableDataset, make_loader

    def loader():
        shards = ShardedIterableDataset(
            [str(s) for s in range(8)],
            _read_shard,
            shard_lengths=[12] * 8,
            seed=0,
            rank=0,
            world_size=1,
        )
        return make_loader(shards, batch_size=4, num_workers=0)

    whole, final = _train(
        tmp_path / "whole", loader(), max_steps=60
    )  # 24 batches per pass: 2.5 passes
    head, _ = _train(tmp_path / "crashed", loader(), max_steps=60, stop_at=33)  # in the second pass
    rest, resumed = _train(tmp_path / "crashed", loader(), max_steps=60, resume=True)
    assert head + rest == whole and resumed == final
    passes = [
        collections.Counter(i for batch in whole[24 * p : 24 * (p + 1)] for i in batch)
        for p in range(2)
    ]
    assert passes == [collections.Counter(range(N))] * 2 and whole[:24] != whole[24:48]
