"""`RankEpoch`: what one rank of a `ShardedIterableDataset` reads in an epoch: each worker's
pieces, their mixing schedule and their samples.

Use when: the dataset (or its resume, `epoch_resume.py`) needs a consumer's (rank x worker)
pieces or samples: of the epoch's shards (`shard_plan.py`), or of an elastic resume's rest
(`EpochRest`, dealt over the new ranks as an epoch is).
Cost: a plan is a permutation and a few numpy operations; a stream is `shard_reading.py`'s.
Adapt here: nothing; the dataset builds it from its settings.
Trade-off: a record of settings, rebuilt on each call (cheap), so that a copy of the dataset for
another rank (a resume replaying the old ranks) is `for_rank(...)`, never a patched copy.
Copy with: common/caches/packed_strings.py, common/sampling/sharding.py,
  common/shards/epochs/shard_mixing.py, common/shards/epochs/shard_plan.py,
  common/shards/epochs/shard_reading.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from recipes.common.sampling.sharding import Piece, fragment_pieces
from recipes.common.shards.epochs.shard_mixing import Schedule
from recipes.common.shards.epochs.shard_plan import ShardPlan
from recipes.common.shards.epochs.shard_reading import ShardReading


class EpochRest(NamedTuple):
    """What no rank received of an interrupted epoch (an elastic resume's), read in its place."""

    epoch: int
    generation: int  # how many shapes the epoch had before: seeds the rest's mixing apart
    fragments: np.ndarray  # int64 [F, 3]: shard, start, stop


class MixingSeed(NamedTuple):
    """The seed of a consumer's mixing, and in a rest the samples a piece stands for."""

    seed: tuple[int, ...]
    piece: float | None = None


@dataclass(frozen=True)
class RankEpoch:
    """One rank's reads: the plan's settings, the reading's, this rank, and a rest if any."""

    plan: ShardPlan
    reading: ShardReading
    rank: int
    world_size: int
    mixes: bool
    rest: EpochRest | None = None

    def for_rank(self, rank: int, world_size: int, **changes) -> RankEpoch:
        """The same reads for another rank of another world (a resume's old ranks); `changes`:
        `nodes=` (of the plan) or `rest=`."""
        plan = self.plan
        if "nodes" in changes:
            plan = dataclasses.replace(plan, nodes=changes.pop("nodes"))
        return dataclasses.replace(self, plan=plan, rank=rank, world_size=world_size, **changes)

    def _rest_of(self, epoch: int) -> EpochRest | None:
        if self.rest is not None and self.rest.epoch == epoch:
            return self.rest
        return None

    def pieces(self, epoch: int, worker: int = 0, num_workers: int = 1) -> list[Piece]:
        """The pieces (shard, start, stop) that consumer (rank, worker) reads in `epoch`: of
        the epoch's shards (`shard_plan.py`), or of an elastic resume's rest."""
        rest = self._rest_of(epoch)
        if rest is not None:
            return fragment_pieces(
                rest.fragments,
                rank=self.rank,
                world_size=self.world_size,
                worker=worker,
                num_workers=num_workers,
                even=self.plan.even,
            )
        return self.plan.pieces(
            epoch,
            rank=self.rank,
            world_size=self.world_size,
            worker=worker,
            num_workers=num_workers,
        )

    def samples_in(self, pieces: list[Piece]) -> int | None:
        """How many samples `pieces` hold (None: a piece to the end of a shard of unknown
        length)."""
        total = 0
        for shard, start, stop in pieces:
            if stop is None:
                if self.plan.shard_lengths is None:
                    return None
                stop = int(self.plan.shard_lengths[shard])
            total += stop - start
        return total

    def mixing_seed(self, epoch: int, worker: int) -> MixingSeed:
        """The mixing's seed (and in an elastic resume's rest the samples a piece stands for)."""
        rest = self._rest_of(epoch)
        if rest is None:
            return MixingSeed((self.plan.seed, epoch, self.rank, worker))
        lengths = self.plan.shard_lengths
        piece = None
        if len(lengths):
            piece = float(lengths.mean())
        return MixingSeed((self.plan.seed, epoch, self.rank, worker, rest.generation), piece)

    def schedule(
        self,
        epoch: int,
        worker: int,
        num_workers: int = 1,
        pieces: list[Piece] | None = None,
        draws_needed: int | None = None,
    ) -> Schedule:
        """The mixing schedule of consumer (rank, worker) (of `pieces`, when given)."""
        if pieces is None:
            pieces = self.pieces(epoch, worker, num_workers)
        mixing = self.mixing_seed(epoch, worker)
        return self.reading.schedule(
            pieces, seed=mixing.seed, piece=mixing.piece, draws_needed=draws_needed
        )

    def stream(self, epoch: int, worker: int, num_workers: int, skip: int = 0) -> Iterator:
        """The samples of consumer (rank, worker) in `epoch`, after the first `skip`."""
        pieces = self.pieces(epoch, worker, num_workers)
        upcoming: Callable[[], list] = list
        if self.reading.cache is not None:  # the next epoch's first pieces, to download ahead
            upcoming = functools.partial(self.pieces, epoch + 1, worker, num_workers)
        if not self.mixes:
            yield from self.reading.in_order(pieces, skip, upcoming)
            return
        mixing = self.mixing_seed(epoch, worker)
        yield from self.reading.mixed(pieces, skip, upcoming, seed=mixing.seed, piece=mixing.piece)
