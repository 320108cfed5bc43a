"""Run under torchrun (2 gloo processes): ImageFolderFast with DistributedSampler and
make_loader."""

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from recipes.common import make_loader
from recipes.vision import ImageFolderFast, uint8_collate


def main(root: str, report: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ImageFolderFast(root, size=48)  # eval crops: an image's pixels identify it
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = make_loader(ds, batch_size=4, sampler=sampler, collate_fn=uint8_collate, num_workers=1)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen, steps = [], 0
        for images, _ in loader:
            seen += [
                hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest() for image in images
            ]
            step = torch.tensor([1.0])
            dist.all_reduce(step)  # one collective per step: unequal batch counts would hang here
            steps += 1
        epochs.append({"seen": seen, "steps": steps})
    gathered = [None] * world
    dist.all_gather_object(gathered, epochs)
    if rank == 0:
        every = {
            hashlib.sha1(ds[i][0].contiguous().numpy().tobytes()).hexdigest()
            for i in range(len(ds))
        }
        result = {
            "disjoint": all(
                not set(gathered[0][e]["seen"]) & set(gathered[1][e]["seen"]) for e in range(2)
            ),
            "covered": all(
                set(gathered[0][e]["seen"]) | set(gathered[1][e]["seen"]) == every for e in range(2)
            ),
            "equal_steps": all(
                gathered[0][e]["steps"] == gathered[1][e]["steps"] for e in range(2)
            ),
            "reshuffled": all(
                gathered[r][0]["seen"] != gathered[r][1]["seen"] for r in range(world)
            ),
        }
        with open(report, "w") as f:
            json.dump(result, f)
    loader.close()  # its persistent worker ends now, not in interpreter finalisation
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
