"""The rest of an interrupted epoch of shards, to be dealt over another shape (an elastic resume).

Use when: a `ShardedIterableDataset` epoch interrupted on R ranks x K workers resumes on R' x K'
(a node lost, more GPUs): `rest_fragments` gives the samples no rank had received, as ranges of
shards, which the new ranks split as they split an epoch (`sharding.fragment_pieces`), each new
consumer mixing its share (`shard_mixing.py`).
Cost: per resume, the old consumers' plans and mixing schedules rebuilt (numpy, no I/O) and a
few arrays of one entry per sample of the epoch (about 30 bytes a sample, freed after); no
shard is read or downloaded for what was received.
Adapt here: nothing.
Trade-off: the rest is dealt anew: no uninterrupted run of the new shape exists to follow. It
is ordered by the old consumer that was to read each sample (rank-major), then by the epoch's
shard order, so the new ranks of a node tend to get the rest of the old ranks of that node, whose
shards its cache holds. Only what the old plan had (its ranks' padding repeats and, with whole
shards, the surplus it skipped aside) is in the rest, so the epoch covers what it would have.
Copy with: common/shards/epochs/shard_mixing.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recipes.common.shards.epochs.shard_mixing import Schedule, skip_counts

Ranges = tuple[
    np.ndarray, np.ndarray, np.ndarray
]  # shards, starts, stops (int64, one entry a range)


def consumer_ranges(
    pieces: Sequence[tuple[int, int, int]], schedule: Schedule | None, skip: int
) -> tuple[Ranges, Ranges]:
    """`(the ranges of a consumer's plan, the ranges of its first skip samples)`: the first
    `skip` draws of its mixing `schedule`, each block's first samples; without one, its pieces
    (known stops) read front to back."""
    array = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    planned = (array[:, 0], array[:, 1], array[:, 2])
    if schedule is not None:
        return planned, (
            schedule.shards,
            schedule.starts,
            schedule.starts + skip_counts(schedule, skip),
        )
    shards = []
    starts = []
    stops = []
    for shard, start, stop in pieces:
        if skip <= 0:
            break
        take = min(skip, stop - start)
        shards.append(shard)
        starts.append(start)
        stops.append(start + take)
        skip -= take
    return planned, tuple(np.asarray(x, dtype=np.int64) for x in (shards, starts, stops))


def rest_fragments(
    shard_lengths: np.ndarray, order: np.ndarray, consumers: Sequence[tuple[Ranges, Ranges]]
) -> np.ndarray:
    """The samples the old consumers were to read and did not: int64 `[F, 3]` (shard, start,
    stop), ordered by the first consumer whose plan holds each sample, then by the shard's place
    in the epoch's `order`, then by sample.

    Args:
        shard_lengths: samples per shard.
        order: the epoch's shard order.
        consumers: per old consumer (rank-major), `(its plan's ranges, its consumed ranges)`.
    """
    offsets = np.concatenate(([0], np.cumsum(shard_lengths, dtype=np.int64)))
    owner = np.full(int(offsets[-1]), -1, dtype=np.int32)
    received = np.zeros(int(offsets[-1]), dtype=bool)
    for c in range(len(consumers) - 1, -1, -1):  # the first consumer holding a sample owns it
        owner[_sample_ids(consumers[c][0], offsets)] = c
    for _, consumed in consumers:
        received[_sample_ids(consumed, offsets)] = True
    rest = np.flatnonzero((owner >= 0) & ~received)
    if not len(rest):  # every sample received (a state saved after the epoch's last batch)
        return np.zeros((0, 3), dtype=np.int64)
    shard = np.searchsorted(offsets, rest, side="right") - 1
    place = np.empty(len(order), dtype=np.int64)
    place[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    ordered = np.lexsort((rest, place[shard], owner[rest]))
    rest = rest[ordered]
    shard = shard[ordered]
    local = rest - offsets[shard]
    first = np.ones(len(rest), dtype=bool)  # where a run of consecutive samples of one shard begins
    first[1:] = (shard[1:] != shard[:-1]) | (local[1:] != local[:-1] + 1)
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:], len(rest)) - 1
    return np.stack([shard[heads], local[heads], local[tails] + 1], axis=1).astype(np.int64)


def _sample_ids(ranges: Ranges, offsets: np.ndarray) -> np.ndarray:
    """The global sample ids (`offsets[shard] + i`) of every range, concatenated."""
    shards, starts, stops = (np.asarray(x, dtype=np.int64) for x in ranges)
    lengths = np.maximum(stops - starts, 0)
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    base = offsets[shards] + starts - (np.cumsum(lengths) - lengths)
    return np.repeat(base, lengths) + np.arange(total, dtype=np.int64)
