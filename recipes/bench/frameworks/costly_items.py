"""The workload of `recipes bench hf`: items that cost a set CPU time (or wait, as on storage),
map-style or as virtual shards, our loader over them, and a tiny model to train.

Use when: a framework benchmark needs a loader whose cost per item is known exactly, so the
figures are the loops' and the loader's, not a decoder's.
Cost: `item_us` of busy-waiting (or sleeping) per item; the model is one linear layer.
Adapt here: the item (`_item`), the virtual shard size (`SHARD_SIZE`).
Trade-off: synthetic items say nothing about real decoding; they isolate the loop's overhead.
"""

from __future__ import annotations

import functools
import json
import time

import torch
from torch.utils.data import Dataset

from recipes.common import ShardedIterableDataset, make_loader

SHARD_SIZE = 64  # items per virtual shard of the iterable kind


def _burn(microseconds: float) -> None:
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        pass


def _item(i: int, total: int) -> dict:
    return {
        "x": torch.tensor([i / total, (i % 7) / 7]),
        "labels": torch.tensor([float(i % 3)]),
        "idx": i,
    }


class CostlyItems(Dataset):
    """Map-style: item i costs `item_us` of CPU (or, `wait=True`, of waiting, as on storage),
    then a dict of small tensors."""

    def __init__(self, n: int, item_us: float, *, wait: bool = False):
        self.n = n
        self.item_us = item_us
        self.wait = wait

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.wait:
            time.sleep(self.item_us / 1e6)
        else:
            _burn(self.item_us)
        return _item(i, self.n)


def read_costly_shard(
    name: str, start: int = 0, stop: int | None = None, *, size: int, total: int, item_us: float
):
    """A virtual shard of `size` items (shard `name` holds items name * size ...)."""
    first = int(name) * size
    if stop is None:
        stop = size
    for i in range(first + start, first + stop):
        _burn(item_us)
        yield _item(i, total)


def costly_dataset(kind: str, n: int, item_us: float):
    """`n` items of `item_us` each: map-style (`kind="map"`) or as virtual shards."""
    if kind == "map":
        return CostlyItems(n, item_us)
    shards = [str(s) for s in range(-(-n // SHARD_SIZE))]
    lengths = [min(SHARD_SIZE, n - SHARD_SIZE * s) for s in range(len(shards))]
    read = functools.partial(read_costly_shard, size=SHARD_SIZE, total=n, item_us=item_us)
    return ShardedIterableDataset(shards, read, shard_lengths=lengths, seed=0, rank=0, world_size=1)


def shuffle_of(kind: str) -> dict:
    """The loader's `shuffle=` for `kind`: map-style items are shuffled by the sampler."""
    if kind == "map":
        return {"shuffle": True}
    return {}


def our_loader(kind: str, n: int, item_us: float, args):
    torch.manual_seed(0)
    return make_loader(
        costly_dataset(kind, n, item_us),
        batch_size=args.batch_size,
        num_workers=args.workers,
        path="workers",
        **shuffle_of(kind),
    )


def state_after(kind: str, n: int, batches: int, args) -> dict:
    """Our loader's state after `batches` batches, read at zero cost per item."""
    loader = our_loader(kind, n, 0.0, args)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    del iterator
    loader.close()
    return json.loads(json.dumps(state))  # what a checkpoint file gives back


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, labels, idx=None):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}
