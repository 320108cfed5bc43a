"""Run under torchrun (2 processes, gloo): LengthBucketSampler takes the world from torch.distributed."""

import json
import sys

import numpy as np
import torch.distributed as dist

from recipes.common import LengthBucketSampler

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
lengths = np.random.default_rng(0).integers(1, 300, 1001)
sampler = LengthBucketSampler(lengths, max_tokens=1024, seed=7)  # no num_replicas / rank given
assert (sampler.num_replicas, sampler.rank) == (world, rank)
sampler.set_epoch(1)
batches = list(sampler)
gathered = [None] * world
dist.all_gather_object(gathered, batches)
if rank == 0:
    counts = [len(b) for b in gathered]
    seen = [i for rank_batches in gathered for b in rank_batches for i in b]
    report = {"world": world, "counts": counts, "covered": sorted(set(seen)) == list(range(len(lengths))),
              "extra": len(seen) - len(lengths)}
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
dist.barrier()
dist.destroy_process_group()
