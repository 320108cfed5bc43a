"""Exact sharding of a sample range over ranks x DataLoader workers.

Use when: an IterableDataset must split its data among every consumer (each DDP rank, and
each DataLoader worker inside it) so that nothing is read twice and nothing is lost, and
ranks yield the same number of samples (DDP hangs when one rank runs out first).
Cost: O(1) arithmetic; the result is a numpy array (or an empty one).
Adapt here: the `even` padding rule.
Trade-off: contiguous blocks (good for range reads); a consumer's block is not interleaved
with the others'.

Consumers are numbered rank-major: consumer `rank * num_workers + worker`. Ranks get
contiguous blocks of `range(n)`; each rank's block is split contiguously among its workers
(sizes differ by at most one).
- `even=False`: every index exactly once; rank blocks differ in size by at most one.
- `even=True`: every rank gets exactly `ceil(n / world_size)` indices. The last
  `(-n) % world_size` positions (at most `world_size - 1`) repeat indices from the start of
  `range(n)`, in order (0, 1, ...). Workers within a rank differ by at most one, which DDP does
  not see (the DataLoader merges them into the rank's stream).
Copy with: nothing.
"""

from __future__ import annotations

import numpy as np


def shard_indices(
    n: int, *, rank: int, world_size: int, worker: int, num_workers: int, even: bool = True
) -> np.ndarray:
    """The indices of `range(n)` that consumer (rank, worker) owns.

    Args:
        n: the number of samples (or shards).
        rank, world_size: this rank and the number of ranks.
        worker, num_workers: this DataLoader worker and the workers per rank (1 without workers).
        even: equal counts per rank by repeating at most `world_size - 1` indices (module
            docstring).

    Returns:
        int64 indices, ascending except for the padding repeats at the end of the last ranks.

    Raises:
        ValueError: for out-of-range arguments.
    """
    for name, value in (("n", n), ("rank", rank), ("worker", worker)):
        if value < 0:
            raise ValueError(f"`{name}` must be non-negative, but is {value!r} instead.")
    for name, value in (("world_size", world_size), ("num_workers", num_workers)):
        if value <= 0:
            raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
    if rank >= world_size or worker >= num_workers:
        raise ValueError(
            f"(rank, worker) = ({rank}, {worker}) is outside world_size={world_size}, "
            f"num_workers={num_workers}."
        )
    if even:
        per_rank = -(-n // world_size)
        start = rank * per_rank
        stop = (rank + 1) * per_rank
        positions = np.arange(start, stop, dtype=np.int64)
        rank_indices = positions % n if n else positions[:0]
    else:
        lo, hi = _block(n, world_size, rank)
        rank_indices = np.arange(lo, hi, dtype=np.int64)
    lo, hi = _block(len(rank_indices), num_workers, worker)
    return rank_indices[lo:hi]


def round_robin_position(batches: list[int], done: int) -> tuple[list[int], int]:
    """Where DataLoader's round-robin over iterable workers stands after `done` batches, the
    workers having `batches[w]` each (a worker that runs out leaves the round): `(batches each
    worker gave, the worker whose batch comes next)` (worker 0 when the epoch is over)."""
    skipped = [0] * len(batches)
    round_ = 0
    while any(b > round_ for b in batches):
        for w, count in enumerate(batches):
            if count > round_:
                if done == 0:
                    return skipped, w
                skipped[w] += 1
                done -= 1
        round_ += 1
    return skipped, 0


def distributed_world() -> tuple[int, int]:
    """(world_size, rank) of the initialised `torch.distributed` group, else (1, 0)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def checked_ranks(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """`(num_replicas, rank)`, each `torch.distributed`'s where None (else 1 and 0), checked.

    Raises:
        ValueError: a rank outside [0, num_replicas).
    """
    world, here = distributed_world()
    if num_replicas is None:
        num_replicas = world
    if rank is None:
        rank = here
    if not 0 <= int(rank) < int(num_replicas):
        raise ValueError(
            f"`rank` must be in [0, {int(num_replicas)}), but is {int(rank)!r} instead."
        )
    return int(num_replicas), int(rank)


def _block(n: int, parts: int, part: int) -> tuple[int, int]:
    """[lo, hi) of `part` when `range(n)` is cut into `parts` contiguous blocks (sizes differ by <=
    1)."""
    base, extra = divmod(n, parts)
    lo = part * base + min(part, extra)
    return lo, lo + base + (1 if part < extra else 0)


# ---- a consumer's pieces of an epoch's shards (`ShardedIterableDataset.plan`) ------------------
Piece = tuple[int, int, "int | None"]  # shard index, first sample, stop (None: to the end)


def range_pieces(
    shard_lengths: np.ndarray,
    order: np.ndarray,
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    even: bool,
) -> list[Piece]:
    """The consumer's `shard_indices` of the shards concatenated in `order`, as `(shard, start,
    stop)` ranges (a run of positions may span several shards)."""
    order = np.asarray(order, dtype=np.int64)
    lengths = np.asarray(shard_lengths, dtype=np.int64)[order]
    fragments = np.stack([order, np.zeros_like(order), lengths], axis=1)
    return fragment_pieces(
        fragments,
        rank=rank,
        world_size=world_size,
        worker=worker,
        num_workers=num_workers,
        even=even,
    )


def fragment_pieces(
    fragments: np.ndarray, *, rank: int, world_size: int, worker: int, num_workers: int, even: bool
) -> list[Piece]:
    """The consumer's `shard_indices` of `fragments` (int64 `[F, 3]`: shard, start, stop, read
    one after another), as `(shard, start, stop)` ranges: a run of positions may span several
    fragments, and with `even` the last ranks' padding repeats the first fragments' samples."""
    total = int((fragments[:, 2] - fragments[:, 1]).sum())
    positions = shard_indices(
        total, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, even=even
    )
    return position_pieces(fragments, positions)


def node_fragments(
    fragments: np.ndarray, *, node: int, nodes: int, ranks_per_node: int, even: bool
) -> np.ndarray:
    """The samples of `fragments` that the ranks of `node` (ranks `node * ranks_per_node` on)
    read, as fragments: the positions `shard_indices` gives those ranks together, except that
    with `even` the last node's padding repeats its own first samples (no shard of another
    node's to download). O(fragments): positions stay runs, never arrays."""
    total = int((fragments[:, 2] - fragments[:, 1]).sum())
    world = nodes * ranks_per_node
    first = node * ranks_per_node
    if not even:
        runs = [
            (_block(total, world, first)[0], _block(total, world, first + ranks_per_node - 1)[1])
        ]
    else:
        per_rank = -(-total // world)
        lo = first * per_rank
        hi = (first + ranks_per_node) * per_rank
        if lo < total:  # its share, then (the last node) its own first samples again
            runs = [(lo, min(hi, total))]
            left = hi - min(hi, total)
            own = (lo, total)
        else:  # a node wholly past the end (fewer samples than ranks): the order again, from lo
            runs = []
            left = hi - lo
            own = (0, total)
        at = own[0] if lo < total else lo % max(total, 1)
        while left > 0 and total:
            take = min(left, own[1] - at)
            runs.append((at, at + take))
            left = left - take
            at = own[0]
    lengths = fragments[:, 2] - fragments[:, 1]
    ends = np.cumsum(lengths)
    pieces: list[Piece] = []
    for lo, hi in runs:
        _run_pieces(fragments, lengths, ends, lo, hi, pieces)
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 3)


def _run_pieces(
    fragments: np.ndarray,
    lengths: np.ndarray,
    ends: np.ndarray,
    lo: int,
    hi: int,
    pieces: list[Piece],
) -> None:
    """Positions `[lo, hi)` of the fragments concatenated, appended to `pieces` as ranges (the
    fragments it spans at once: numpy, not a step per fragment)."""
    if lo >= hi:
        return
    first = int(np.searchsorted(ends, lo, side="right"))
    last = int(np.searchsorted(ends, hi - 1, side="right"))
    span = slice(first, last + 1)
    begins = ends[span] - lengths[span]  # each spanned fragment's first position
    low = np.maximum(begins, lo)
    high = np.minimum(ends[span], hi)
    keep = high > low
    starts = fragments[span, 1] + (low - begins)
    stops = fragments[span, 1] + (high - begins)
    pieces.extend(
        zip(
            fragments[span, 0][keep].tolist(),
            starts[keep].tolist(),
            stops[keep].tolist(),
            strict=True,
        )
    )


def position_pieces(fragments: np.ndarray, positions: np.ndarray) -> list[Piece]:
    """`positions` of the fragments concatenated, as `(shard, start, stop)` ranges."""
    lengths = fragments[:, 2] - fragments[:, 1]
    ends = np.cumsum(lengths)
    pieces: list[Piece] = []
    if len(positions) == 0:
        return pieces
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1  # runs of consecutive positions
    for run in np.split(positions, breaks):
        _run_pieces(fragments, lengths, ends, int(run[0]), int(run[-1]) + 1, pieces)
    return pieces


def shard_pieces(
    shard_lengths: np.ndarray | None,
    order: np.ndarray,
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    even: bool,
) -> list[Piece]:
    """The consumer's whole shards of `order` (contiguous blocks); with `even` over several
    ranks, cut to the smallest rank's sample count (needs `shard_lengths`)."""
    n = len(order)
    mine = shard_indices(
        n, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, even=False
    )
    pieces: list[Piece] = [(int(order[p]), 0, None) for p in mine]
    if not (even and world_size > 1):
        return pieces
    lengths = shard_lengths[order]
    quota = min(int(lengths[slice(*_block(n, world_size, r))].sum()) for r in range(world_size))
    rank_lo, rank_hi = _block(n, world_size, rank)
    for w in range(worker):  # the earlier workers of this rank use their share of the quota first
        a, b = _block(rank_hi - rank_lo, num_workers, w)
        quota -= int(lengths[rank_lo + a : rank_lo + b].sum())
    out = []
    left = max(quota, 0)
    for shard, _, _ in pieces:
        if left <= 0:
            break
        size = int(shard_lengths[shard])
        out.append((shard, 0, None) if size <= left else (shard, 0, left))
        left -= min(size, left)
    return out
