"""The resume of an interrupted epoch of shards: where each worker stands after the batches a
DataLoader yielded, the rest of the epoch read from there, and the rest an elastic resume deals.

Use when: `ShardedIterableDataset.resume_after` (a `StatefulLoader` resuming) must start an
epoch after its first `batches_done` batches: `ResumePoint` records the interrupted loader's
settings, `resume_position` finds each worker's place in its stream, `resumed_samples` yields
the rest (in the workers' roles, rotated, or interleaved in one process when the worker or rank
count changed), and `rest_after` works out what no rank received over earlier shapes of the
epoch (`shard_reshape.py`).
Cost: with `shard_lengths`, arithmetic over the plan (no I/O); without them and with several
workers, the epoch's first `batches_done` batches are read again to find the positions.
Adapt here: nothing.
Trade-off: DataLoader yields its workers' batches round-robin, skipping a worker once it is
exhausted; the positions follow that rule exactly, so a loader that yields in another order (a
custom sampler of workers) would need its own.
Copy with: common/caches/packed_strings.py, common/sampling/sharding.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from recipes.common.sampling.sharding import round_robin_position
from recipes.common.shards.epochs.rank_epoch import EpochRest, RankEpoch
from recipes.common.shards.epochs.shard_reshape import consumer_ranges, rest_fragments


class ResumePoint(NamedTuple):
    """Where an interrupted epoch stopped, and the loader settings that yielded it."""

    batches_done: int
    batch_size: int | None
    drop_last: bool
    num_workers: int  # the interrupted loader's (at least 1)
    interleave: bool  # another worker count resumes: the rest in one process, in the old order
    world_size: int  # the interrupted epoch's ranks

    @property
    def per_batch(self) -> int:
        """Samples per batch (1 without batching)."""
        if self.batch_size is None:
            return 1
        return self.batch_size


class Position(NamedTuple):
    """Each worker's place in its stream after the batches done, and whose batch comes next."""

    skips: list[int]  # samples each worker skips
    first: int  # the worker that yields the next batch


class EarlierShape(NamedTuple):
    """One earlier shape of an epoch, as a loader state lists it (`resume_after(reshaped=)`)."""

    ranks: int
    workers: int
    batches: int  # batches each rank received
    nodes: int = 1

    @classmethod
    def of(cls, shape: Sequence[int]) -> EarlierShape:
        return cls(*(int(value) for value in shape[:4]))


def batches_of(samples: int, per_batch: int, drop_last: bool) -> int:
    """The batches `samples` make (a last partial one dropped with `drop_last`)."""
    if drop_last:
        return samples // per_batch
    return -(-samples // per_batch)


def resume_position(reads: RankEpoch, epoch: int, point: ResumePoint) -> Position:
    """Each worker's place after `point.batches_done` batches of the round-robin."""
    workers = point.num_workers
    batches = []
    for w in range(workers):
        samples = reads.samples_in(reads.pieces(epoch, w, workers))
        if samples is None:  # unknown lengths: one worker made every batch; several may run out
            if workers == 1:
                return Position([point.batches_done * point.per_batch], 0)
            return _replayed_position(reads, epoch, point)
        batches.append(batches_of(samples, point.per_batch, point.drop_last))
    skipped, first = round_robin_position(batches, point.batches_done)
    return Position([s * point.per_batch for s in skipped], first)


def _replayed_position(reads: RankEpoch, epoch: int, point: ResumePoint) -> Position:
    """Without `shard_lengths`: the workers' streams read in the DataLoader's round-robin
    (a worker that runs out leaves it) up to `done` batches, to find each one's position.
    Exact, at the cost of reading the epoch's first `done` batches (in every worker)."""
    workers = point.num_workers
    per_batch = point.per_batch
    done = point.batches_done
    streams = {w: reads.stream(epoch, w, workers) for w in range(workers)}
    skipped = [0] * workers
    while streams:
        for w in range(workers):
            if w not in streams:
                continue
            if done == 0:
                return Position([s * per_batch for s in skipped], w)
            got = sum(1 for _ in itertools.islice(streams[w], per_batch))
            if got == 0 or (point.drop_last and got < per_batch):
                del streams[w]
                continue
            skipped[w] += 1
            done -= 1
    return Position([s * per_batch for s in skipped], 0)


class ConsumedShape(NamedTuple):
    """One earlier shape of an epoch, with the samples each of its consumers received
    (`ShardedIterableDataset.resume_consumed`): a reader that knows its own counts (a mixture that
    replays its draws) rather than a loader's batch count."""

    ranks: int
    workers: int
    received: Sequence[Sequence[int]]  # [rank][worker]: samples that consumer received
    nodes: int = 1


def rest_after(
    reads: RankEpoch,
    epoch: int,
    shapes: Sequence[Sequence[int]],
    batch_size: int | None,
    drop_last: bool,
) -> np.ndarray:
    """What no consumer received in the epoch's earlier `shapes` (oldest first), each shape's
    ranks reading the rest of the shape before it (`shard_reshape.py`)."""
    rest = None
    for generation, shape in enumerate(map(EarlierShape.of, shapes)):
        workers = max(1, shape.workers)
        point = ResumePoint(shape.batches, batch_size, bool(drop_last), workers, False, shape.ranks)
        former_rest = _former(epoch, generation, rest)
        received = []
        for rank in range(shape.ranks):
            former = reads.for_rank(rank, shape.ranks, nodes=shape.nodes, rest=former_rest)
            received.append(resume_position(former, epoch, point).skips)
        consumed = ConsumedShape(shape.ranks, workers, received, shape.nodes)
        rest = _rest_step(reads, epoch, generation, rest, consumed)
    return rest


def rest_after_consumed(
    reads: RankEpoch, epoch: int, shapes: Sequence[ConsumedShape]
) -> np.ndarray | None:
    """What no consumer received in the epoch's earlier `shapes` (oldest first), given the
    samples each consumer received (None when there are no shapes)."""
    rest = None
    for generation, shape in enumerate(shapes):
        rest = _rest_step(reads, epoch, generation, rest, shape)
    return rest


def _former(epoch: int, generation: int, rest: np.ndarray | None) -> EpochRest | None:
    if rest is None:
        return None
    return EpochRest(epoch, generation, rest)


def _rest_step(
    reads: RankEpoch,
    epoch: int,
    generation: int,
    rest: np.ndarray | None,
    shape: ConsumedShape,
) -> np.ndarray:
    """The rest after one shape whose consumers read the rest before it (`rest`, None: the
    epoch) and received `shape.received` samples each."""
    lengths = reads.plan.shard_lengths
    former_rest = _former(epoch, generation, rest)
    workers = max(1, int(shape.workers))
    consumers = []
    for rank in range(int(shape.ranks)):
        former = reads.for_rank(rank, int(shape.ranks), nodes=int(shape.nodes), rest=former_rest)
        for w in range(workers):
            skip = int(shape.received[rank][w])
            pieces = [
                (shard, start, _known_stop(stop, lengths[shard]))
                for shard, start, stop in former.pieces(epoch, w, workers)
            ]
            schedule = None
            if former.mixes:
                schedule = former.schedule(epoch, w, workers, pieces, draws_needed=skip)
            consumers.append(consumer_ranges(pieces, schedule, skip))
    return rest_fragments(lengths, reads.plan.order(epoch), consumers)


def _known_stop(stop: int | None, length) -> int:
    if stop is None:
        return int(length)
    return stop


def resumed_samples(reads: RankEpoch, epoch: int, point: ResumePoint, worker: int) -> Iterator:
    """The rest of the interrupted epoch that this worker yields."""
    if point.world_size != reads.world_size:  # other ranks than the interrupted epoch's
        for old_rank in range(reads.rank, point.world_size, reads.world_size):
            former = reads.for_rank(old_rank, point.world_size)
            yield from interleaved(former, epoch, point, resume_position(former, epoch, point))
        return
    position = resume_position(reads, epoch, point)
    if point.interleave:  # other worker count than the interrupted epoch: replay its order here
        yield from interleaved(reads, epoch, point, position)
        return
    # DataLoader starts its round-robin at worker 0: rotate the roles so that the worker due
    # next in the interrupted epoch comes first.
    worker = (worker + position.first) % point.num_workers
    yield from reads.stream(epoch, worker, point.num_workers, position.skips[worker])


def interleaved(reads: RankEpoch, epoch: int, point: ResumePoint, position: Position) -> Iterator:
    """The rest of an interrupted epoch in the order its DataLoader would have yielded it:
    the old workers' batches round-robin, as lists (or single samples without batching)."""
    workers = point.num_workers
    order = [(position.first + j) % workers for j in range(workers)]
    streams = {w: reads.stream(epoch, w, workers, position.skips[w]) for w in order}
    while streams:
        for w in order:
            if w not in streams:
                continue
            batch = list(itertools.islice(streams[w], point.batch_size or 1))
            short = point.batch_size is not None and len(batch) < point.batch_size
            if not batch or (point.drop_last and short):
                del streams[w]
                continue
            if point.batch_size:
                yield batch
            else:
                yield batch[0]
