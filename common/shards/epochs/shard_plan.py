"""`ShardPlan`: which pieces of which shards each consumer (rank x worker) reads in an epoch.

Use when: `ShardedIterableDataset` cuts an epoch's shards among its consumers (consumer = rank
x worker, see `shard_indices`):
- at least as many shards as consumers, or unknown `shard_lengths`: whole shards, in the
  epoch's shuffled order, contiguous blocks per consumer;
- fewer shards than consumers with `shard_lengths` (or `split="samples"`): sample ranges of the
  epoch's concatenated shards, so no consumer idles and none reads samples it discards.
With `even=True` every rank yields the same number of samples per epoch:
- sample ranges: `ceil(total / world_size)` per rank; at most `world_size - 1` samples from the
  start of the epoch's order repeat;
- whole shards: every rank stops at the smallest rank's sample count; the surplus of the other
  ranks (the ends of their last shards) is skipped that epoch, a different part each epoch.
Both need `shard_lengths` when `world_size > 1`.
Cost: a permutation of the shard list per epoch (torch, seeded by `(seed, epoch)`), and per
consumer a few numpy operations over the shard lengths.
Adapt here: nothing; the dataset passes every setting.
Trade-off, node-affine (`nodes > 1`: several nodes, each with a cache of its own): the shards
are cut among the nodes once, by a permutation fixed across epochs, and each epoch shuffles only
the order of a node's own pieces among its ranks; a node then reads, and downloads, the same
shards every epoch (LitData does the same for its full shuffle). Each epoch still reads every
sample once over all ranks, and the global batch (every rank's samples together) is a sample
stratified by node, each node's stratum an equal share of the data, which is as uniform as an
unstratified one; what is lost is that samples of two nodes never meet in one rank's batch, so
shards written sorted (by class, by source) would give each node's ranks a part of the classes:
write them shuffled (`write_shards`' default).
Copy with: common/sampling/sharding.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recipes.common.sampling.sharding import (
    Piece,
    fragment_pieces,
    node_fragments,
    range_pieces,
    shard_pieces,
)


@dataclass(frozen=True)
class ShardPlan:
    """The settings that decide who reads what; `nodes > 1` (the ranks in node-contiguous
    blocks, as torchrun numbers them) makes the plan node-affine."""

    num_shards: int
    shard_lengths: np.ndarray | None
    shuffle: bool
    seed: int
    even: bool
    split: str
    nodes: int = 1

    def order(self, epoch: int) -> np.ndarray:
        """Shard indices in the order of `epoch` (epoch -1: the node-affine cut's, fixed)."""
        if not self.shuffle:
            return np.arange(self.num_shards)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_shards, generator=g).numpy()

    def pieces(
        self, epoch: int, *, rank: int, world_size: int, worker: int, num_workers: int
    ) -> list[Piece]:
        """The pieces `(shard, start, stop)` that consumer (rank, worker) reads in `epoch`."""
        where = dict(
            rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, even=self.even
        )
        if self.nodes > 1 and world_size % self.nodes == 0:
            return self._node_pieces(epoch, **where)
        order = self.order(epoch)
        if self.shard_lengths is not None and (
            self.split == "samples" or len(order) < world_size * num_workers
        ):
            return range_pieces(self.shard_lengths, order, **where)
        return shard_pieces(self.shard_lengths, order, **where)

    def _node_pieces(
        self, epoch: int, *, rank: int, world_size: int, worker: int, num_workers: int, even: bool
    ) -> list[Piece]:
        """Node-affine: this rank's node's fixed share (sample ranges of the shards in the fixed
        order), its pieces shuffled per epoch, cut among the node's ranks."""
        per_node = world_size // self.nodes
        node, local = divmod(rank, per_node)
        fixed = self.order(-1)
        lengths = self.shard_lengths[fixed]
        mine = node_fragments(
            np.stack([fixed, np.zeros_like(fixed), lengths], axis=1),
            node=node,
            nodes=self.nodes,
            ranks_per_node=per_node,
            even=even,
        )
        mine = mine[
            np.random.default_rng([self.seed, epoch, node, 0x6E6F6465]).permutation(len(mine))
        ]
        return fragment_pieces(
            mine, rank=local, world_size=per_node, worker=worker, num_workers=num_workers, even=even
        )
