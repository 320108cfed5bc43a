"""Sample-level mixing of a consumer's shards: the order `ShardedIterableDataset` reads them in.

Use when: shards were written in the order the data came (by class, by source, by date), and
reading them one after another would give batches of one class.
Cost: per consumer and epoch, one sort of its blocks by a jittered position (numpy, no I/O);
memory: at most `INTERLEAVE` blocks read at once (a block is one sample of a tar, a row group
of a Parquet file); about `WINDOW` shards in use at any time, sliding along the plan.
Adapt here: `WINDOW`, `INTERLEAVE`.
Trade-off: samples mix over a band of about `WINDOW` shards that slides along the consumer's
(shuffled) shards, not over the whole epoch, and the first and last band's worth mix over fewer;
a shuffled write (`write_shards(shuffle=True)`) mixes the rest.

The order, for one consumer (rank x worker) in one epoch, from its plan (the pieces `(shard,
start, stop)` it reads, whose shards come in the epoch's shuffled order):
1. each piece is cut into blocks (ranges read in one call) at `block_starts(shard)`;
2. each block gets a key: its first sample's position in the plan plus a uniform jitter of up
   to `window` pieces' worth of samples (a local shuffle: nothing moves further than that, so
   the shards needed at a time are a sliding band, downloaded in turn as in shard order); the
   reach starts at one piece and grows to `window` over the first `window / 2` pieces, so the
   first batch waits for the first shards only;
3. blocks are sorted by key, taken in groups of `interleave`, and a group's samples come in a
   uniformly random interleaving of its blocks (each block read front to back).
Every draw comes from a generator seeded by `(seed, epoch, rank, worker)`, so the order is a
function of the plan: a resume after `n` samples counts each block's samples among the first
`n` draws (`skip_counts`) and starts each block there, reading nothing it skips.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

WINDOW = 16
INTERLEAVE = 8
START = 8  # the reach at the epoch's start, in pieces


@dataclass(frozen=True)
class Schedule:
    """A consumer's epoch: its blocks (sorted) and, per sample, which block gives it.
    `shards`, `starts`, `stops`: int64 `[K]` (blocks); `draws`: int32 `[N]` (samples)."""

    shards: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    draws: np.ndarray

    def __len__(self) -> int:
        return len(self.draws)


def mixing_schedule(pieces: Sequence[tuple[int, int, int]], *, block_starts: Callable[[int], np.ndarray],
                    seed: Sequence[int], window: int = WINDOW, interleave: int = INTERLEAVE) -> Schedule:
    """The order of a consumer's epoch (module docstring).

    Args:
        pieces: `(shard, start, stop)` with known stops, in plan order.
        block_starts: a shard's block starts (ascending sample indices, the first 0).
        seed: the generator's entropy, e.g. `(seed, epoch, rank, worker)`.
        window: how far a sample may move, in pieces (their mean length in samples).
        interleave: blocks read at once.
    """
    rng = np.random.default_rng([*seed])
    shards, starts, stops = _blocks(pieces, block_starts)
    sizes = stops - starts
    total = int(sizes.sum())
    piece = total / max(1, len(pieces))
    places = np.cumsum(sizes) - sizes
    # the reach grows from one piece to `window` pieces over the epoch's first `window / 2`
    # pieces: the first batches need the first shards only (as in shard order), not the whole
    # band, which would all have to be downloaded before the first batch
    reach = np.minimum(window * piece, START * piece + places)
    keys = places + rng.random(len(sizes)) * reach
    order = np.argsort(keys, kind="stable")
    shards, starts, stops, sizes = shards[order], starts[order], stops[order], sizes[order]
    draws = np.empty(total, dtype=np.int32)
    at = 0
    for g in range(0, len(shards), interleave):
        group = np.repeat(np.arange(g, g + len(sizes[g : g + interleave]), dtype=np.int32), sizes[g : g + interleave])
        draws[at : at + len(group)] = rng.permutation(group)
        at += len(group)
    return Schedule(shards, starts, stops, draws)


def _blocks(pieces, block_starts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shards, starts, stops = [], [], []
    for shard, start, stop in pieces:
        cuts = np.asarray(block_starts(shard), dtype=np.int64)
        inner = cuts[(cuts > start) & (cuts < stop)]
        edges = np.concatenate(([start], inner, [stop]))
        starts.append(edges[:-1])
        stops.append(edges[1:])
        shards.append(np.full(len(edges) - 1, shard, dtype=np.int64))
    if not shards:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(shards), np.concatenate(starts), np.concatenate(stops)


def skip_counts(schedule: Schedule, skip: int) -> np.ndarray:
    """Samples of each block among the first `skip` draws (int64 `[K]`)."""
    return np.bincount(schedule.draws[:skip], minlength=len(schedule.shards)).astype(np.int64)
