"""Sample-level mixing of a consumer's shards: the order `ShardedIterableDataset` reads them in.

Use when: shards were written in the order the data came (by class, by source, by date), and
reading them one after another would give batches of one class.
Cost: per consumer and epoch, one sort of its blocks by a jittered position (numpy, no I/O);
memory: at most `INTERLEAVE` blocks read at once (a block is one sample of a tar, a row group
of a Parquet file); about `WINDOW` shards in use at any time, sliding along the plan.
Adapt here: `WINDOW`, `INTERLEAVE`, `START`; `SHUFFLE_BUFFER_BYTES` (`write_shards` of a stream).
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

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

WINDOW = 16
INTERLEAVE = 8
START = 8  # the reach at the epoch's start, in pieces
ORDER_VERSION = 3  # raised whenever the order a schedule gives changes: a loader state records it
# (3: a group's interleaving drawn as one sort of random keys, not a permutation per group)
SHUFFLE_BUFFER_BYTES = 256 * 2**20  # write_shards' shuffle of a stream


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


def mixing_schedule(
    pieces: Sequence[tuple[int, int, int]],
    *,
    block_starts: Callable[[int], np.ndarray],
    seed: Sequence[int],
    window: int = WINDOW,
    interleave: int = INTERLEAVE,
    piece_samples: float | None = None,
    draws_needed: int | None = None,
) -> Schedule:
    """The order of a consumer's epoch (module docstring).

    Args:
        pieces: `(shard, start, stop)` with known stops, in plan order.
        block_starts: a shard's block starts (ascending sample indices, the first 0).
        seed: the generator's entropy, e.g. `(seed, epoch, rank, worker)`.
        window: how far a sample may move, in pieces (their mean length in samples).
        interleave: blocks read at once.
        piece_samples: the samples a piece stands for in `window` (default: the pieces' mean
            length); an elastic resume's rest, cut into many small ranges, passes a shard's.
        draws_needed: make only the draws up to the end of the group holding this many (what
            `skip_counts` of up to that many needs: an elastic resume's arithmetic).
    """
    rng = np.random.default_rng([*seed])
    shards, starts, stops = _blocks(pieces, block_starts)
    sizes = stops - starts
    total = int(sizes.sum())
    piece = total / max(1, len(pieces)) if piece_samples is None else float(piece_samples)
    places = np.cumsum(sizes) - sizes
    # the reach grows from one piece to `window` pieces over the epoch's first `window / 2`
    # pieces: the first batches need the first shards only (as in shard order), not the whole
    # band, which would all have to be downloaded before the first batch
    reach = np.minimum(window * piece, START * piece + places)
    keys = places + rng.random(len(sizes)) * reach
    order = np.argsort(keys, kind="stable")
    shards = shards[order]
    starts = starts[order]
    stops = stops[order]
    sizes = sizes[order]
    # each group's samples in a uniformly random interleaving: a random key in [0, 1) per sample
    # added to its group's number, one sort (groups follow one another)
    blocks = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    groups = blocks // interleave
    noise = rng.random(total)
    if draws_needed is not None and draws_needed < total:
        cut = (
            int(np.searchsorted(groups, groups[draws_needed - 1], side="right"))
            if draws_needed > 0
            else 0
        )
        blocks = blocks[:cut]
        groups = groups[:cut]
        noise = noise[:cut]
    draws = blocks[np.argsort(groups + noise, kind="stable")]
    return Schedule(shards, starts, stops, draws)


def _blocks(pieces, block_starts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces cut at their shards' (ascending) block starts; each shard's asked for once (an
    elastic resume's rest holds many small pieces of the same shards)."""
    shards = []
    starts = []
    stops = []
    known = {}
    for shard, start, stop in pieces:
        cuts = known.get(shard)
        if cuts is None:
            cuts = known[shard] = np.asarray(block_starts(shard), dtype=np.int64)
        inner = cuts[
            np.searchsorted(cuts, start, side="right") : np.searchsorted(cuts, stop, side="left")
        ]
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


def need_order(schedule: Schedule, skip: int = 0) -> list[int]:
    """The shards in the order the draws after the first `skip` first need them."""
    needed = schedule.shards[schedule.draws[skip:]]
    _, first = np.unique(needed, return_index=True)
    return [int(s) for s in needed[np.sort(first)]]


def mixed_samples(
    schedule: Schedule,
    skip: int,
    read_block: Callable[[int, int, int], list],
    first_need: Callable[[int], None] | None = None,
) -> Iterator:
    """The samples in the schedule's order after the first `skip`: each block's samples from
    `read_block(shard, start, stop)` (a list, taken from its end: read in reverse), called when
    the block is first drawn, starting after its samples among the skipped draws.
    `first_need(k)` is called when the draws reach the `k`-th shard of `need_order` (to download
    the next ones)."""
    done = skip_counts(schedule, skip)
    draws = schedule.draws[skip:]
    rank = (
        {s: k for k, s in enumerate(need_order(schedule, skip))} if first_need is not None else {}
    )
    reading: dict[int, list] = {}
    frontier = -1  # the furthest shard of the need order drawn so far
    for j in draws.tolist():
        if j not in reading:
            shard = int(schedule.shards[j])
            if first_need is not None and rank[shard] > frontier:
                frontier = rank[shard]
                first_need(frontier)
            reading[j] = read_block(
                shard, int(schedule.starts[j]) + int(done[j]), int(schedule.stops[j])
            )
        block = reading[j]
        item = block.pop()
        if not block:
            del reading[j]
        yield item


# ---- the writer's side: `write_shards(shuffle=True)` ------------------------------------------
def shuffled_samples(
    samples: Iterable[dict], *, seed: int = 0, buffer_bytes: int = SHUFFLE_BUFFER_BYTES
):
    """`samples` in a random order: a sequence (len and indexing) as a permuted view, indexed
    lazily; any other iterable through a buffer of about `buffer_bytes` of samples, each next
    sample drawn from it at random (the rest, in a random order, at the end)."""
    rng = np.random.default_rng(seed)
    if isinstance(samples, Sequence) or (
        hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
    ):
        return _Permuted(samples, rng.permutation(len(samples)))
    return _buffered(iter(samples), rng, buffer_bytes)


class _Permuted:
    def __init__(self, samples, order: np.ndarray):
        self.samples = samples
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int):
        return self.samples[int(self.order[index])]

    def __iter__(self):
        return (self.samples[int(i)] for i in self.order)


def _buffered(samples, rng, buffer_bytes: int):
    held = []
    sizes = []
    total = 0
    for sample in samples:
        held.append(sample)
        sizes.append(_sample_bytes(sample))
        total += sizes[-1]
        while total > buffer_bytes and held:
            i = int(rng.integers(len(held)))
            held[i], held[-1] = held[-1], held[i]
            sizes[i], sizes[-1] = sizes[-1], sizes[i]
            total -= sizes.pop()
            yield held.pop()
    for i in rng.permutation(len(held)):
        yield held[int(i)]


def _sample_bytes(sample) -> int:
    """About what a sample holds in memory: bytes and text by length, arrays by `nbytes`, JSON
    values by their encoding's length."""
    if not isinstance(sample, dict):
        return 64
    total = 64
    for value in sample.values():
        if isinstance(value, (bytes, bytearray, str)):
            total += len(value)
        elif hasattr(value, "nbytes"):  # numpy arrays, memoryviews, tensors
            total += int(value.nbytes)
        elif isinstance(value, (dict, list, tuple)):
            total += len(json.dumps(value, default=str))
        else:
            total += 8
    return total
