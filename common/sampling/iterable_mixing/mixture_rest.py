"""The rest of an interrupted `MixtureIterable` epoch: what each old consumer (rank x worker)
received of each source, each source's rest dealt over the new shape, and a consumer's stream
going on from a loader's batch count.

Use when: a loader resumes a `MixtureIterable` (`resume_after`) on the same or another number
of ranks and workers. Each consumer's stream is a function of the settings, so the batches a
loader received say how many samples each old consumer gave (DataLoader's round-robin over its
workers), and replaying that consumer's draws says how many came from each source; each source
then deals what no consumer received over the new shape (`resume_consumed`), and the new
consumers draw from those rests with generators seeded by the rest's generation.
Cost: per resume, each old consumer's draws replayed up to what it gave, one draw a sample:
arithmetic with shares in samples; with shares in tokens (`lengths`) its samples are read again
(their lengths decide the draws). Each source's rest is `ShardedIterableDataset`'s (numpy over
the epoch's samples, no reading).
Adapt here: nothing.
Trade-off: the rest's interleave is drawn anew: no uninterrupted run of the new shape exists to
follow, so its order is not the uninterrupted run's, its samples are (every sample of the epoch
once). On the same shape the stream goes on exactly as it would have.
Copy with: common/resume/state_keys.py, common/resume/state_records.py,
  common/sampling/iterable_mixing/mixture_draws.py, common/sampling/sharding.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from recipes.common.resume.state_records import ResumeAt
from recipes.common.sampling.iterable_mixing.mixture_draws import interleaved
from recipes.common.sampling.sharding import round_robin_position


class Consumer(NamedTuple):
    """One reader of an epoch: a worker of a rank, in a shape of ranks x workers."""

    rank: int
    ranks: int
    worker: int
    workers: int


class Shape(NamedTuple):
    """One earlier shape of an epoch, as a loader state lists it (`resume_after(reshaped=)`)."""

    ranks: int
    workers: int
    batches: int  # batches each rank received

    @classmethod
    def of(cls, saved: Sequence[int]) -> Shape:
        ranks, workers, batches = (int(value) for value in list(saved)[:3])
        return cls(ranks, max(1, workers), batches)


class MixtureRest(NamedTuple):
    """What no consumer received of an epoch over its earlier shapes."""

    epoch: int
    generation: int  # how many shapes the epoch had before: seeds the rest's draws apart
    sources: list  # each source's copy over its rest (the sources themselves at generation 0)
    start: float  # the schedule's progress at the rest's start


class Replayed(NamedTuple):
    """A consumer's draws replayed up to a number of samples."""

    stream: Iterator  # its (source, sample) pairs from there on
    counts: np.ndarray  # samples it gave of each source
    units: float  # the schedule's units it gave (samples, or tokens)


def consumer_lengths(sources: list, rank: int, ranks: int, workers: int) -> np.ndarray:
    """Each source's samples for each worker of `rank`: int64 `[S, workers]`."""
    return np.stack([np.asarray(s.consumer_lengths(rank, ranks, workers=workers)) for s in sources])


def positions(totals: Sequence[int], point: ResumeAt) -> tuple[list[int], int]:
    """The samples each worker of a rank gave (its stream `totals[w]` long) after
    `point.batches_done` batches of DataLoader's round-robin, and the worker due next."""
    per_batch = point.per_batch
    batches = []
    for total in totals:
        if point.drop_last:
            batches.append(int(total) // per_batch)
        else:
            batches.append(-(-int(total) // per_batch))
    skipped, first = round_robin_position(batches, point.batches_done)
    gave = [min(b * per_batch, int(t)) for b, t in zip(skipped, totals, strict=True)]
    return gave, first


def replay(
    mixture, rest: MixtureRest, consumer: Consumer, samples: int, mine: np.ndarray
) -> Replayed:
    """`consumer`'s draws over `rest` replayed for its first `samples`: without `lengths`,
    without reading (each source `mine[s]` placeholders: its samples for this consumer); with
    them, reading its samples."""
    draws = mixture.draws_for(consumer, rest.generation, rest.start)
    active = mixture.usable.copy()
    reading = mixture.lengths is not None
    if reading:
        iterators = [_samples_of(source, consumer) for source in rest.sources]
    else:
        iterators = [itertools.repeat(None, int(n)) for n in mine]
    stream = interleaved(iterators, active, mixture.rule(draws))
    counts = np.zeros(len(rest.sources), dtype=np.int64)
    for _ in range(samples):
        source, _ = next(stream)
        counts[source] += 1
    units = float(samples)
    if getattr(draws, "progress", None) is not None and draws.progress.tokens:
        units = float(draws.tokens)
    if not reading:  # the real samples from where the placeholders stopped
        iterators = [
            _samples_of(source, consumer, skip=int(count))
            for source, count in zip(rest.sources, counts.tolist(), strict=True)
        ]
        stream = interleaved(iterators, active, mixture.rule(draws))
    return Replayed(stream, counts, units)


def rest_over(mixture, shapes: Sequence[Shape], batch_size, drop_last: bool) -> MixtureRest:
    """What no consumer received over the epoch's earlier `shapes` (oldest first), each
    shape's consumers reading the rest of the shape before it."""
    datasets = list(mixture.datasets)
    rest = MixtureRest(mixture.epoch, 0, datasets, mixture.epoch_start())
    received: list[list[tuple]] = [[] for _ in datasets]  # per source, its consumed shapes
    for shape in shapes:
        point = ResumeAt(shape.batches, batch_size, bool(drop_last), shape.workers, False)
        counts = np.zeros((len(datasets), shape.ranks, shape.workers), dtype=np.int64)
        units = 0.0
        for rank in range(shape.ranks):
            lengths = consumer_lengths(rest.sources, rank, shape.ranks, shape.workers)
            gave, _ = positions(lengths[mixture.usable].sum(axis=0).tolist(), point)
            for worker, samples in enumerate(gave):
                consumer = Consumer(rank, shape.ranks, worker, shape.workers)
                replayed = replay(mixture, rest, consumer, samples, lengths[:, worker])
                counts[:, rank, worker] = replayed.counts
                units += replayed.units
        for s, dataset in enumerate(datasets):
            nodes = int(getattr(dataset, "nodes", 1))
            received[s].append((shape.ranks, shape.workers, counts[s].tolist(), nodes))
        sources = [d.resume_consumed(received[s]) for s, d in enumerate(datasets)]
        rest = MixtureRest(rest.epoch, rest.generation + 1, sources, rest.start + units)
    return rest


def continued(mixture, rest: MixtureRest, consumer: Consumer, point: ResumeAt | None) -> Iterator:
    """`consumer`'s samples of `rest`: from its start (`point` None), or after `point`'s
    batches of this shape, in the role of the old worker due next (DataLoader starts its
    round-robin at worker 0), or with `point.interleave` every old worker's in one process, as
    whole batches in the old order."""
    if point is None:
        lengths = consumer_lengths(rest.sources, consumer.rank, consumer.ranks, consumer.workers)
        yield from _samples(replay(mixture, rest, consumer, 0, lengths[:, consumer.worker]).stream)
        return
    lengths = consumer_lengths(rest.sources, consumer.rank, consumer.ranks, point.workers)
    gave, first = positions(lengths[mixture.usable].sum(axis=0).tolist(), point)
    if not point.interleave:
        role = (consumer.worker + first) % point.workers
        old = Consumer(consumer.rank, consumer.ranks, role, point.workers)
        yield from _samples(replay(mixture, rest, old, gave[role], lengths[:, role]).stream)
        return
    order = [(first + j) % point.workers for j in range(point.workers)]
    streams = {}
    for w in order:
        old = Consumer(consumer.rank, consumer.ranks, w, point.workers)
        streams[w] = _samples(replay(mixture, rest, old, gave[w], lengths[:, w]).stream)
    while streams:
        for w in order:
            if w not in streams:
                continue
            batch = list(itertools.islice(streams[w], point.per_batch))
            short = len(batch) < point.per_batch
            if not batch or (point.drop_last and short):
                del streams[w]
                continue
            if point.batch_size is None:
                yield batch[0]
            else:
                yield batch


def _samples(stream: Iterator) -> Iterator:
    for _, item in stream:
        yield item


def _samples_of(source, consumer: Consumer, skip: int = 0) -> Iterator:
    """`consumer`'s samples of `source` (of the epoch, or of its rest), after its first `skip`."""
    return source.consumer_samples(
        consumer.rank,
        consumer.ranks,
        worker=consumer.worker,
        workers=consumer.workers,
        skip=skip,
    )
