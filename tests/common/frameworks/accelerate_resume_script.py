"""Trains a tiny model under `accelerate` from a recipes loader (`prepare_loader`), for
`test_accelerate_resume.py`: `torchrun --nproc_per_node 2 accelerate_resume_script.py WORKDIR KIND
[--stop-after N]`.

KIND: `workers` (a `DistributedSampler`, one persistent worker per rank), `elastic` (make_loader's
own sampler under the process group, an `ElasticDistributedSampler`, one persistent worker) or
`bucket` (a `LengthBucketSampler` under a token budget, batches made in the loop's process). Every
step appends `epoch idx idx ...` to `WORKDIR/samples-rank<r>.txt`; `accelerator.save_state` runs
every `SAVE_EVERY` steps into `WORKDIR/ckpt`, which a later launch resumes (`load_state`). The first
batch of the first epoch this launch trains is timed into `WORKDIR/first-batch-rank<r>.txt` (from
`iter()`), the final weights written to `WORKDIR/weights.json` by rank 0. `--stop-after N` ends the
process with `os._exit` after step N (a crash: no clean-up)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

N, EPOCHS, SAVE_EVERY = 96, 3, 3
LENGTHS = ((np.arange(N) * 7) % 13 + 3).tolist()


class Items(Dataset):
    """Item i: a row of LENGTHS[i] values i / N, and its index."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {"x": torch.full((LENGTHS[i],), i / N), "idx": i}


def collate(items):
    width = max(len(item["x"]) for item in items)
    x = torch.zeros(len(items), 16)
    for row, item in enumerate(items):
        x[row, : len(item["x"])] = item["x"]
    return {"x": x, "idx": torch.tensor([item["idx"] for item in items]), "width": width}


def build_loader(kind: str):
    from recipes.common import LengthBucketSampler, make_loader

    dataset = Items()
    if kind == "workers":
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # the torch.distributed world
        return make_loader(
            dataset,
            batch_size=4,
            sampler=sampler,
            collate_fn=collate,
            num_workers=1,
            persistent_workers=True,
            path="workers",
        )
    if kind == "elastic":  # the loader splits the ranks itself: resumable on another number of them
        return make_loader(
            dataset,
            batch_size=4,
            shuffle=True,
            collate_fn=collate,
            num_workers=1,
            persistent_workers=True,
            path="workers",
        )
    sampler = LengthBucketSampler(
        LENGTHS, max_tokens=64, seed=0
    )  # reads the world, as DistributedSampler
    return make_loader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0)


def main() -> None:
    from accelerate import Accelerator

    from recipes.common.frameworks.accelerate_glue import prepare_loader

    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("kind", choices=["workers", "elastic", "bucket"])
    parser.add_argument("--stop-after", type=int, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    loader = prepare_loader(accelerator, build_loader(args.kind))
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpoint = args.workdir / "ckpt"
    if checkpoint.is_dir():
        accelerator.load_state(str(checkpoint))
    log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    step, timed = 0, False
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        asked = time.perf_counter()
        for batch in loader:
            if not timed:
                (args.workdir / f"first-batch-rank{rank}.txt").write_text(
                    f"{time.perf_counter() - asked:.4f}"
                )
                timed = True
            loss = (model(batch["x"]).squeeze(1) - batch["idx"].float() / N).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            log.write(f"{epoch} " + " ".join(map(str, batch["idx"].tolist())) + "\n")
            log.flush()
            if step % SAVE_EVERY == 0:
                accelerator.save_state(str(checkpoint))
            if args.stop_after is not None and step >= args.stop_after:
                accelerator.wait_for_everyone()
                os._exit(0)
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        (args.workdir / "weights.json").write_text(
            json.dumps({k: v.tolist() for k, v in weights.items()})
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
