"""Run under torchrun (gloo), or plain python for one rank: LengthBucketSampler,
ShardedIterableDataset or MixtureSampler (`mixture`: indices; `mixture_batches`) through
`make_loader` with 2 workers per rank and an all-reduce per step (a rank with fewer batches would
hang the others). Modes: `epoch` (a whole epoch), `stop` (3 steps, then rank 0 saves the loader
state), `resume` (the rest of that epoch, on this world). `kinds` and `modes` are comma-separated
(`bucket,sharded`, `epoch,stop`): one launch serves them all, each kind in `folder/<kind>/`."""

import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from recipes.common import LengthBucketSampler, MixtureSampler, ShardedIterableDataset, make_loader

LENGTHS = np.random.default_rng(0).integers(1, 300, 301)
SHARDS = [13, 22, 30]  # samples per shard: fewer shards than 2 ranks x 2 workers, so sample ranges


class Ids(Dataset):
    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        return i


def read_shard(path, start, stop):
    return [int(x) for x in Path(path).read_text().split()[start:stop]]


def loader_for(kind, folder, world):
    if kind == "bucket":
        sampler = LengthBucketSampler(
            LENGTHS, max_tokens=1024, seed=7
        )  # the world from torch.distributed
        sampler.set_epoch(1)
        return make_loader(
            Ids(), batch_sampler=sampler, num_workers=2, collate_fn=torch.tensor
        ), sampler
    if kind in (
        "mixture",
        "mixture_batches",
    ):  # sources 0-99, 100-300 at 0.7 / 0.3, every sample once
        batches = 5 if kind == "mixture_batches" else None
        sampler = MixtureSampler(
            {"a": 100, "b": 201}, {"a": 0.7, "b": 0.3}, seed=9, batch_size=batches
        )
        sampler.set_epoch(1)
        if batches:
            return make_loader(
                Ids(), batch_sampler=sampler, num_workers=2, collate_fn=torch.tensor
            ), sampler
        return make_loader(Ids(), batch_size=4, sampler=sampler, num_workers=2), sampler
    paths = [str(folder / f"s{k}.txt") for k in range(len(SHARDS))]
    ds = ShardedIterableDataset(paths, read_shard, shard_lengths=SHARDS, seed=3)
    ds.set_epoch(1)
    return make_loader(ds, batch_size=4, num_workers=2), ds


def main(kinds, folder, modes):
    distributed = "LOCAL_RANK" in __import__("os").environ
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    for mode in modes.split(","):
        for kind in kinds.split(","):
            run(kind, Path(folder), Path(folder) / kind, mode, rank, world, distributed)
    if distributed:
        dist.destroy_process_group()


def run(kind, folder, out, mode, rank, world, distributed):
    if rank == 0:
        out.mkdir(exist_ok=True)
    loader, holder = loader_for(kind, folder, world)
    assert (getattr(holder, "num_replicas", None) or holder.world_size) == world
    if mode == "resume":
        loader.load_state_dict(json.loads((out / "state.json").read_text()))
    seen = []
    for step, batch in enumerate(loader):
        if distributed:
            total = torch.tensor([len(batch)])
            dist.all_reduce(total)  # one collective per step, as DDP's gradient all-reduce
        seen.append(batch.tolist())
        if mode == "stop" and step == 2:
            state = loader.state_dict()
            break
    gathered = [seen]
    if distributed:
        gathered = [None] * world
        dist.all_gather_object(gathered, seen)
    if rank == 0:
        (out / f"{mode}.json").write_text(json.dumps({"world": world, "batches": gathered}))
        if mode == "stop":
            (out / "state.json").write_text(json.dumps(state))
        if kind == "bucket" and mode == "epoch":
            (out / "plan.json").write_text(
                json.dumps([b.tolist() for b in holder.global_batches(1)])
            )
        if kind.startswith("mixture") and mode == "epoch":
            (out / "plan.json").write_text(json.dumps(holder.global_indices(1).tolist()))
    del loader  # its workers end before the next kind's start
    if distributed:
        dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
