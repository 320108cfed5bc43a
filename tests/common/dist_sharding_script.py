"""Run under torchrun (2 processes, gloo): ShardedIterableDataset takes the world from torch.distributed."""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from recipes.common import ShardedIterableDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
folder = Path(sys.argv[1])
lengths = [7, 3, 9]  # 3 shards < 2 ranks x 2 workers: sample ranges
shards = [str(folder / f"s{i}.txt") for i in range(len(lengths))]
if rank == 0:
    for i, n in enumerate(lengths):
        Path(shards[i]).write_text("".join(f"{i * 100 + j}\n" for j in range(n)))
dist.barrier()


def read(path, start, stop):
    lines = Path(path).read_text().split()
    return [int(x) for x in lines[start:stop]]


ds = ShardedIterableDataset(shards, read, shard_lengths=lengths, seed=3)  # no rank / world_size given
assert (ds.rank, ds.world_size) == (rank, world)
samples = [int(x) for x in DataLoader(ds, batch_size=None, num_workers=2)]
gathered = [None] * world
dist.all_gather_object(gathered, samples)
if rank == 0:
    expected = sorted(i * 100 + j for i, n in enumerate(lengths) for j in range(n))
    with open(folder / "report.json", "w") as f:
        json.dump({"counts": [len(g) for g in gathered], "union": sorted({x for g in gathered for x in g}) == expected,
                   "total": sum(len(g) for g in gathered), "expected": len(expected)}, f)
dist.barrier()
dist.destroy_process_group()
