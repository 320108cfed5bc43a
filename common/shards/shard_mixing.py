"""Sample-level mixing of a consumer's shards: the order `ShardedIterableDataset` reads them in.

Use when: shards were written in the order the data came (by class, by source, by date), and
reading them one after another would give batches of one class.
Cost: per consumer and epoch, one permutation of its samples within each window (numpy, no I/O);
memory: `WINDOW` shards in use at once (pinned in a `PrefetchCache`), at most `INTERLEAVE`
blocks read at once (a block is one sample of a tar, a row group of a Parquet file).
Adapt here: `WINDOW`, `INTERLEAVE`.
Trade-off: samples mix within a window of shards, not over the whole epoch: a window spans
`WINDOW` shards drawn at random each epoch, so shards of one class each still give batches of
about `WINDOW` classes; a shuffled write (`write_shards(shuffle=True)`) mixes the rest.

The order, for one consumer (rank x worker) in one epoch, from its plan (the pieces `(shard,
start, stop)` it reads, whose shards come in the epoch's shuffled order):
1. the pieces are taken in windows of `window` consecutive pieces;
2. each piece is cut into blocks (ranges read in one call) at `block_starts(shard)`;
3. a window's blocks are permuted, then taken in groups of `interleave`, and a group's samples
   come in a uniformly random interleaving of its blocks (each block read front to back).
With one-sample blocks this is a uniformly random permutation of the window's samples. Every
draw comes from a generator seeded by `(seed, epoch, rank, worker, window)`, so the order is a
function of the plan: a resume after `n` samples counts each block's samples among the first
`n` draws (`skip_counts`) and starts each block there, reading nothing it skips.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

WINDOW = 16
INTERLEAVE = 8


@dataclass(frozen=True)
class Window:
    """One window's schedule: its blocks (after the permutation) and, per sample, which block
    gives it. `shards`, `starts`, `stops`: int64 `[K]` (blocks); `draws`: int32 `[N]` (samples)."""

    shards: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    draws: np.ndarray

    def __len__(self) -> int:
        return len(self.draws)


def mixing_windows(pieces: Sequence[tuple[int, int, int]], *, block_starts: Callable[[int], np.ndarray],
                   seed: Sequence[int], window: int = WINDOW, interleave: int = INTERLEAVE) -> Iterator[Window]:
    """The windows of a consumer's epoch, lazily (a window's schedule is made when reached).

    Args:
        pieces: `(shard, start, stop)` with known stops, in plan order.
        block_starts: a shard's block starts (ascending sample indices, the first 0).
        seed: the generator's entropy, e.g. `(seed, epoch, rank, worker)`.
        window, interleave: pieces per window; blocks read at once.
    """
    for w, first in enumerate(range(0, len(pieces), window)):
        rng = np.random.default_rng([*seed, w])
        shards, starts, stops = _blocks(pieces[first : first + window], block_starts)
        order = rng.permutation(len(shards))
        shards, starts, stops = shards[order], starts[order], stops[order]
        draws = np.empty(int((stops - starts).sum()), dtype=np.int32)
        at = 0
        for g in range(0, len(shards), interleave):
            sizes = stops[g : g + interleave] - starts[g : g + interleave]
            group = np.repeat(np.arange(g, g + len(sizes), dtype=np.int32), sizes)
            draws[at : at + len(group)] = rng.permutation(group)
            at += len(group)
        yield Window(shards, starts, stops, draws)


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


def skip_counts(window: Window, skip: int) -> np.ndarray:
    """Samples of each block among the window's first `skip` draws (int64 `[K]`)."""
    return np.bincount(window.draws[:skip], minlength=len(window.shards)).astype(np.int64)
