"""Trains a tiny model with `transformers.Trainer` from a recipes loader (`LoaderTrainerMixin`),
for `test_hf_trainer_resume.py`: `torchrun --nproc_per_node 2 hf_trainer_resume_script.py WORKDIR
[--stop-at N] [--accumulate G]` (also runs as one process with `python`).

The loader: a `DistributedSampler` (shuffled, seed 0) with one persistent worker per rank,
batches of 4 of 96 items: 12 batches per rank per epoch, 3 epochs. Every training step appends
`idx idx ...` to `WORKDIR/samples-rank<r>.txt`. The Trainer checkpoints every 3 steps into
`WORKDIR/out`; a launch with a checkpoint there resumes the last one. `--stop-at N` ends the
process with `os._exit` as step N + 1 begins, right after checkpoint N (a crash, no clean-up).
The resumed epoch's first batch is timed from its `on_epoch_begin` into
`WORKDIR/first-batch-rank<r>.txt`; rank 0 writes the final weights to `WORKDIR/weights.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler

N, EPOCHS, SAVE_EVERY = 96, 3, 3


class Items(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {
            "x": torch.tensor([i / N, (i % 7) / 7]),
            "labels": torch.tensor([float(i % 3)]),
            "idx": i,
        }


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, labels, idx=None):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


def main() -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from recipes.common import make_loader
    from recipes.common.frameworks.hf_trainer_glue import LoaderTrainerMixin

    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", 0))
    log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    timing = {"asked": None, "done": False}

    class LoaderTrainer(LoaderTrainerMixin, Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if not timing["done"] and timing["asked"] is not None:
                (args.workdir / f"first-batch-rank{rank}.txt").write_text(
                    f"{time.perf_counter() - timing['asked']:.4f}"
                )
                timing["done"] = True
            log.write(" ".join(map(str, inputs["idx"].tolist())) + "\n")
            log.flush()
            return super().training_step(model, inputs, num_items_in_batch)

    class Stop(TrainerCallback):
        def on_epoch_begin(self, train_args, state, control, **kwargs):
            timing["asked"] = time.perf_counter()

        def on_step_begin(self, train_args, state, control, **kwargs):
            if args.stop_at is not None and state.global_step == args.stop_at:
                os._exit(0)

    out = args.workdir / "out"
    training = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=EPOCHS,
        save_steps=SAVE_EVERY,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        learning_rate=0.05,
        seed=0,
        disable_tqdm=True,
        gradient_accumulation_steps=args.accumulate,
    )
    torch.manual_seed(0)
    model = Tiny()
    dataset = Items()
    sampler = DistributedSampler(
        dataset, num_replicas=int(os.environ.get("WORLD_SIZE", 1)), rank=rank, shuffle=True, seed=0
    )  # built before the Trainer, which starts the process group
    loader = make_loader(
        dataset,
        batch_size=4,
        sampler=sampler,
        num_workers=1,
        persistent_workers=True,
        path="workers",
    )
    trainer = LoaderTrainer(model=model, args=training, train_loader=loader)
    trainer.add_callback(
        Stop()
    )  # after the loader's checkpoint callback: a stop follows the whole save
    resume = out.is_dir() and any(p.name.startswith("checkpoint-") for p in out.iterdir())
    trainer.train(resume_from_checkpoint=True if resume else None)
    if rank == 0:
        weights = model.state_dict()
        (args.workdir / "weights.json").write_text(
            json.dumps({k: v.tolist() for k, v in weights.items()})
        )


if __name__ == "__main__":
    main()
