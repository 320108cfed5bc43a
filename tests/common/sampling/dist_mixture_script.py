"""Run under torchrun (gloo): `MixtureSampler.set_weights` on real ranks through `make_loader`'s
default path (which reads ahead). Modes: `mismatch` (rank 1 passes other weights: every rank
records the error), `changes` (changes at steps 3 and 6, stop after step 9; rank 0 saves the
loader state), `resume` (the saved state on this world, a change at step 2, the rest of the
epoch). Each rank writes what it received to `folder/<mode>-<rank>.json`."""

import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from torch.utils.data import ConcatDataset, Dataset

from recipes.common import MixtureSampler, make_loader

SIZES = [300, 200, 100]
BATCH = 8
CHANGES = ([0.1, 0.1, 0.8], [0.6, 0.3, 0.1], [0.2, 0.7, 0.1])


class Ids(Dataset):
    def __init__(self, first, n):
        self.first = first
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.first + int(i)


def build():
    firsts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    data = ConcatDataset([Ids(int(f), n) for f, n in zip(firsts, SIZES, strict=True)])
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2], seed=7, batch_size=BATCH)
    mix.set_epoch(1)
    return mix, make_loader(data, batch_sampler=mix)


def main(mode, folder):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    mix, loader = build()
    out = {"batches": [], "changes": {}}
    if mode == "mismatch":
        weights = list(CHANGES[0])
        if rank == 1:
            weights[0] += 0.5
        try:
            mix.set_weights(weights)
        except ValueError as error:
            out["error"] = str(error)
    else:
        if mode == "resume":
            loader.load_state_dict(json.loads((folder / "state.json").read_text()))
        change_steps = {3: CHANGES[0], 6: CHANGES[1]}
        if mode == "resume":
            change_steps = {2: CHANGES[2]}
        iterator = iter(loader)
        step = -1
        while mode != "changes" or step < 8:  # "changes": 9 steps, then the state
            step += 1
            batch = next(iterator, None)
            if batch is None:
                break
            out["batches"].append(batch.tolist())
            if step + 1 in change_steps:  # after this step, before the next
                position = mix.set_weights(change_steps[step + 1])
                out["changes"][position] = change_steps[step + 1]
        if mode == "changes" and rank == 0:
            (folder / "state.json").write_text(json.dumps(loader.state_dict()))
    (folder / f"{mode}-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
