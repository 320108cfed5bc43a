"""ShardedIterableDataset: shards (local or remote) split exactly over ranks x workers.

Use when: data lives in shard files (tar, parquet, jsonl, ...) read sequentially, on local disk
or object storage, under DDP with several DataLoader workers. A plain IterableDataset is
replicated into every worker and rank; without exact sharding samples repeat or ranks end at
different steps and DDP hangs (webdataset#225, datasets#6437).
Cost: a permutation of the shard list per epoch; reading is `read_shard`'s. With a
`PrefetchCache`, the next shards download in background threads while the current one is read.
Adapt here: `read_shard`; give it `(path, start, stop)` parameters to read sample ranges
without reading the skipped samples (otherwise ranges are cut with `islice`).
Trade-off: samples mix over a band of about `shuffle_window` shards sliding along each
consumer's shards (`shard_mixing.py`), not over the whole epoch; a shuffled write
(`write_shards`' default) mixes what a band cannot.

Order (with `shuffle`): the shards in a random order per epoch, cut among the consumers as
below; then each consumer's samples in a local shuffle: none moves further than `shuffle_window`
of its shards (pieces) from its place (blocks of `blocks` samples read in one call, a few at once),
seeded by `(seed, epoch, rank, worker)`. Mixing needs `shard_lengths` and a ranged `read_shard`
(or `blocks`); without them, each shard is read front to back, in the shuffled shard order.

Who reads what (consumer = rank x worker, see `shard_indices`):
- at least as many shards as consumers, or unknown `shard_lengths`: whole shards, in the
  epoch's shuffled order, contiguous blocks per consumer;
- fewer shards than consumers with `shard_lengths`: sample ranges of the epoch's
  concatenated shards, so no consumer idles and none reads samples it discards.
With `even=True` every rank yields the same number of samples per epoch:
- sample ranges: `ceil(total / world_size)` per rank; at most `world_size - 1` samples from the
  start of the epoch's order repeat;
- whole shards: every rank stops at the smallest rank's sample count; the surplus of the other
  ranks (the ends of their last shards) is skipped that epoch, a different part each epoch.
Both need `shard_lengths` when `world_size > 1`.
Copy with: common/caches/packed_strings.py, common/sampling/sharding.py, common/shards/shard_mixing.py,
  common/shards/shard_reading.py.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.sampling.sharding import Piece, distributed_world, range_pieces, shard_pieces
from recipes.common.shards.shard_mixing import INTERLEAVE, ORDER_VERSION, START, WINDOW, need_order
from recipes.common.shards.shard_reading import ShardReading


class ShardedIterableDataset(IterableDataset):
    """Iterates the samples of `shards` that belong to this rank and worker.

    Args:
        shards: shard paths or fsspec URLs.
        read_shard: `read_shard(path) -> Iterable[sample]`, or `read_shard(path, start, stop)`
            to read a sample range (its second and third parameters required, or named
            `start` and `stop`); gets a local path when `cache` is set.
        shard_lengths: samples per shard, when known (needed for ranges and `even` under DDP).
        shuffle: shuffle the shard order every epoch from `(seed, epoch)`, and mix the samples
            over a sliding band of `shuffle_window` shards (module docstring).
        shuffle_window: how far (in shards: pieces of a consumer's plan) a sample may move from
            its place in the shuffled shard order; 0: shard order only, each shard read front to
            back. Cost: about this many shards are read at random at any time, so with a
            `cache` they should fit in it together (`max_bytes` of about 2 x window x workers x
            shard size per node; less costs downloads again); the band slides, so they are
            downloaded in turn, as in shard order.
        blocks: where a shard may be cut for mixing: an int (every `blocks` samples) or
            `blocks(shard) -> ascending sample indices` (the first 0), each block read whole in
            one `read_shard(path, start, stop)` call when first drawn (memory: `INTERLEAVE`
            blocks). Default: single samples with a ranged `read_shard`; a reader without
            ranges does not mix unless given `blocks` (each block then reads past its start).
        rank, world_size: this rank and the number of ranks; `torch.distributed`'s when
            initialised at construction, else 0 and 1.
        cache: a `PrefetchCache` to download remote shards ahead of reading.
        shard_sha256: each shard's sha256, when known: the cache verifies its copies with it
            (a damaged copy, or one of an older version of the shard, is downloaded again).
        split: "auto" (the rule of the module docstring) or "samples": sample ranges of the
            epoch's concatenated shards whatever the shard count (needs `shard_lengths`), so
            that with `even` every sample is read once per epoch and at most
            `world_size - 1` repeat, where whole shards would skip the surplus of the ranks
            with more samples; a shard on a boundary is read in parts by two consumers.

    Raises:
        ValueError: bad lengths, or `even=True` under DDP without `shard_lengths`.
    """

    def __init__(
        self,
        shards: Sequence[str],
        read_shard: Callable[..., Iterable],
        *,
        shard_lengths: Sequence[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        even: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        cache=None,
        split: str = "auto",
        shard_sha256: Sequence[str] | None = None,
        shuffle_window: int = WINDOW,
        blocks: int | Callable[[int], Sequence[int]] | None = None,
    ):
        if not isinstance(shuffle_window, int) or shuffle_window < 0:
            raise ValueError(f"`shuffle_window` must be a non-negative int, but is {shuffle_window!r} instead.")
        if isinstance(blocks, int) and blocks < 1:
            raise ValueError(f"`blocks` must be a positive int or a callable, but is {blocks!r} instead.")
        self.shuffle_window, self.blocks = shuffle_window, blocks
        if split not in ("auto", "samples"):
            raise ValueError(f"`split` must be 'auto' or 'samples', but is {split!r} instead.")
        if split == "samples" and shard_lengths is None:
            raise ValueError("split='samples' needs `shard_lengths` (the samples per shard) to cut sample ranges.")
        self.split = split
        self.shard_sha256 = None if shard_sha256 is None else list(shard_sha256)
        self.shards = PackedStrings(shards)
        if len(self.shards) == 0:
            raise ValueError("`shards` is empty; pass at least one shard.")
        self.read_shard = read_shard
        self.shard_lengths = None if shard_lengths is None else np.asarray(shard_lengths, dtype=np.int64)
        if self.shard_lengths is not None and (self.shard_lengths.shape != (len(self.shards),)
                                               or (self.shard_lengths < 0).any()):
            raise ValueError(f"`shard_lengths` must hold one non-negative count per shard ({len(self.shards)}).")
        world, here = distributed_world()
        self.world_size = world if world_size is None else world_size
        self.rank = here if rank is None else rank
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank` must be in [0, {self.world_size}), but is {self.rank!r} instead.")
        if even and self.world_size > 1 and self.shard_lengths is None:
            raise ValueError("even=True under DDP needs `shard_lengths` to give every rank the same number of "
                             "samples; pass shard_lengths= (or even=False if your loop tolerates uneven ranks).")
        self.shuffle, self.seed, self.even, self.cache = shuffle, seed, even, cache
        self._ranged = _takes_range(read_shard)
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()  # reaches persistent workers
        self._workers_seen = torch.zeros(1, dtype=torch.int64).share_memory_()  # written by workers

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (in shared memory, so persistent workers see it); call before `iter`.

        With a `cache`, called in the main process, it also starts the epoch's first downloads
        (`start_downloads`), so that they are in flight while the workers start.
        """
        self._epoch.fill_(int(epoch))
        if self.cache is not None and get_worker_info() is None:
            self.start_downloads()

    def start_downloads(self, num_workers: int | None = None) -> list:
        """Starts downloading, in this process's background threads, the shards the workers
        read first this epoch, in the order the DataLoader needs them: each worker's first
        shard, then each one's second, up to `max(cache.prefetch, num_workers)` shards.

        The workers find them in place or in flight: one download per object, under the
        cache's per-key lock. `num_workers` is the DataLoader's (`make_loader`'s loader passes
        it); by default, the count the workers reported last epoch, and without one (the first
        epoch of a plain DataLoader) this rank's first shards in order: each is read this epoch
        by some worker, and the first is the first worker's. Returns the futures.
        """
        if self.cache is None or getattr(self, "_resume", None):  # a resume reads another order
            return []
        workers = num_workers or int(self._workers_seen.item())
        consumers = range(max(workers, 1))
        if self.mixes:  # the order the mixed draws first need them
            orders = [need_order(self._schedule(self.epoch, w, max(workers, 1))) for w in consumers]
        else:
            orders = [[p[0] for p in self.plan(self.epoch, w, max(workers, 1))] for w in consumers]
        rounds = itertools.zip_longest(*orders)
        firsts = dict.fromkeys(self.shards[s] for r in rounds for s in r if s is not None)
        return self.cache.prefetch(list(firsts)[: max(self.cache.depth, workers) * (2 if self.mixes else 1)])

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def plan_settings(self) -> dict:
        """Every setting that shapes an epoch's plan, as JSON (not the ranks: a resume may
        change them); a loader state carries it and refuses to resume under others."""
        if getattr(self, "_shards_crc", None) is None:
            data = self.shards.data.tobytes() + self.shards.offsets.tobytes()
            lengths = b"" if self.shard_lengths is None else self.shard_lengths.tobytes()
            self._shards_crc = (f"{zlib.crc32(data):08x}", None if self.shard_lengths is None
                                else f"{zlib.crc32(lengths):08x}")
        settings = {"num_shards": len(self.shards), "shards": self._shards_crc[0],
                    "shard_lengths": self._shards_crc[1], "shuffle": self.shuffle, "seed": self.seed, "even": self.even}
        if self.split != "auto":  # states saved before `split` existed still match "auto"
            settings["split"] = self.split
        if self.mixes:  # the sample order (states of shard-order reading do not match)
            settings["mixing"] = {"order": ORDER_VERSION, "window": self.shuffle_window, "start": START,
                                  "interleave": INTERLEAVE, "blocks": self._blocks_key()}
        return settings

    def _blocks_key(self):
        """`blocks` as it shapes the order: an int or None as it is; a callable by a checksum of
        the cuts it gives for every shard (two callables that cut alike match, others do not)."""
        if self.blocks is None or isinstance(self.blocks, int):
            return self.blocks
        if getattr(self, "_blocks_crc", None) is None:
            crc = 0
            for shard in range(len(self.shards)):
                crc = zlib.crc32(np.asarray(self.blocks(shard), dtype=np.int64).tobytes(), crc)
            self._blocks_crc = f"{crc:08x}"
        return self._blocks_crc

    # ---- the plan ----------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        """Shard indices in the order of `epoch`."""
        if not self.shuffle:
            return np.arange(len(self.shards))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.shards), generator=g).numpy()

    def plan(self, epoch: int, worker: int = 0, num_workers: int = 1) -> list[Piece]:
        """The pieces (shard, start, stop) that consumer (self.rank, worker) reads in `epoch`."""
        order = self.order(epoch)
        consumers = self.world_size * num_workers
        where = dict(rank=self.rank, world_size=self.world_size, worker=worker, num_workers=num_workers, even=self.even)
        if self.shard_lengths is not None and (self.split == "samples" or len(order) < consumers):
            return range_pieces(self.shard_lengths, order, **where)
        return shard_pieces(self.shard_lengths, order, **where)

    # ---- resuming ----------------------------------------------------------------------
    def resume_after(self, batches_done: int, *, batch_size: int | None, drop_last: bool = False,
                     num_workers: int = 0, interleave: bool = False,
                     world_size: int | None = None) -> ShardedIterableDataset:
        """A copy whose next epoch starts after the first `batches_done` batches that a
        DataLoader with these settings yields (`StatefulLoader` calls it).

        DataLoader yields the workers' batches round-robin, skipping a worker once it is
        exhausted; each worker works out from the plan how many of the first `batches_done`
        were its own, and starts after them, and the roles rotate so that the worker due next
        comes first. With `shard_lengths` this is arithmetic; without them (and with several
        workers) each worker reads the epoch's first `batches_done` batches of every worker's
        stream in that round-robin to find its position: exact, but the prefix is read. With `interleave=True` (the resuming
        loader has another worker count, as after a `RobustLoader` step down), the copy yields
        the rest of the epoch in one process, as whole batches (lists) in the old order: read
        it with `batch_size=None` and the old collate function.

        Elastic: `world_size` is the number of ranks of the interrupted epoch, when it differs
        from this dataset's. Every old rank had done `batches_done` batches (DDP ranks step
        together); this rank replays, in-process as with `interleave`, the rests of the old
        ranks `r` with `r % world_size == rank` (2 -> 1: both; 4 -> 2: two each, so the new
        ranks stay equal when the old count is a multiple of the new one).
        """
        if world_size is not None and world_size != self.world_size:
            if world_size <= 0:
                raise ValueError(f"`world_size` must be positive, but is {world_size!r} instead.")
            interleave = True
        resumed = copy.copy(self)
        resumed._resume = (int(batches_done), batch_size, bool(drop_last), max(1, int(num_workers)), interleave)
        resumed._resume_world = world_size if world_size is not None else self.world_size
        return resumed

    def _resume_position(self, epoch: int) -> tuple[list[int], int]:
        """`(samples each worker skips, the worker that yields the next batch)` of a resume."""
        done, batch_size, drop_last, workers, _ = self._resume
        per_batch = 1 if batch_size is None else batch_size
        batches = []
        for w in range(workers):
            n = self._plan_samples(self.plan(epoch, w, workers))
            batches.append(None if n is None else (n // per_batch if drop_last else -(-n // per_batch)))
        if workers > 1 and None in batches:  # a worker may have run out first: replay to find out
            return self._replayed_position(epoch, done, per_batch, drop_last, workers)
        skipped, round_ = [0] * workers, 0
        active = lambda w: batches[w] > round_  # noqa: E731
        while any(active(w) for w in range(workers)):
            for w in range(workers):
                if active(w):
                    if done == 0:
                        return [s * per_batch for s in skipped], w
                    skipped[w] += 1
                    done -= 1
            round_ += 1
        return [s * per_batch for s in skipped], 0

    def _replayed_position(self, epoch: int, done: int, per_batch: int, drop_last: bool,
                           workers: int) -> tuple[list[int], int]:
        """Without `shard_lengths`: the workers' streams read in the DataLoader's round-robin
        (a worker that runs out leaves it) up to `done` batches, to find each one's position.
        Exact, at the cost of reading the epoch's first `done` batches (in every worker)."""
        streams = {w: self._stream(epoch, w, workers) for w in range(workers)}
        skipped = [0] * workers
        while streams:
            for w in range(workers):
                if w not in streams:
                    continue
                if done == 0:
                    return [s * per_batch for s in skipped], w
                got = sum(1 for _ in itertools.islice(streams[w], per_batch))
                if got == 0 or (drop_last and got < per_batch):
                    del streams[w]
                    continue
                skipped[w] += 1
                done -= 1
        return [s * per_batch for s in skipped], 0

    def _plan_samples(self, pieces: list[Piece]) -> int | None:
        total = 0
        for shard, start, stop in pieces:
            if stop is None:
                if self.shard_lengths is None:
                    return None
                stop = int(self.shard_lengths[shard])
            total += stop - start
        return total

    # ---- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        self._workers_seen.fill_(num_workers)
        epoch = self.epoch
        if not getattr(self, "_resume", None):
            yield from self._stream(epoch, worker, num_workers)
            return
        old_world = getattr(self, "_resume_world", self.world_size)
        if old_world != self.world_size:  # other ranks than the interrupted epoch: replay their rests
            for old_rank in range(self.rank, old_world, self.world_size):
                former = copy.copy(self)
                former.rank, former.world_size = old_rank, old_world
                yield from former._interleaved(epoch, *former._resume_position(epoch))
            return
        skips, first = self._resume_position(epoch)
        workers = self._resume[3]
        if self._resume[4]:  # other worker count than the interrupted epoch: replay its order here
            yield from self._interleaved(epoch, skips, first)
            return
        # DataLoader starts its round-robin at worker 0: rotate the roles so that the worker due
        # next in the interrupted epoch comes first.
        worker = (worker + first) % workers
        yield from self._stream(epoch, worker, workers, skips[worker])

    def _stream(self, epoch: int, worker: int, num_workers: int, skip: int = 0) -> Iterator:
        """The samples of consumer (rank, worker) in `epoch`, after the first `skip`."""
        pieces = self.plan(epoch, worker, num_workers)
        upcoming = (lambda: self.plan(epoch + 1, worker, num_workers)) if self.cache is not None else list
        reading = self._reading()
        if self.mixes:
            yield from reading.mixed(pieces, skip, upcoming, seed=(self.seed, epoch, self.rank, worker))
        else:
            yield from reading.in_order(pieces, skip, upcoming)

    @property
    def mixes(self) -> bool:
        """Whether samples mix (`shuffle` with a window, `shard_lengths`, and a ranged `read_shard`
        or explicit `blocks`); otherwise each shard is read front to back."""
        return bool(self.shuffle and self.shuffle_window and self.shard_lengths is not None
                    and (self._ranged or self.blocks is not None))

    def _reading(self) -> ShardReading:
        return ShardReading(self.shards, self.read_shard, self._ranged, self.shard_lengths, self.cache,
                            self.shard_sha256, self.blocks, self.shuffle_window)

    def _schedule(self, epoch: int, worker: int, num_workers: int = 1, pieces: list[Piece] | None = None):
        pieces = self.plan(epoch, worker, num_workers) if pieces is None else pieces
        return self._reading().schedule(pieces, seed=(self.seed, epoch, self.rank, worker))

    def _interleaved(self, epoch: int, skips: list[int], first: int) -> Iterator:
        """The rest of an interrupted epoch in the order its DataLoader would have yielded it:
        the old workers' batches round-robin, as lists (or single samples without batching)."""
        _, batch_size, drop_last, workers, _ = self._resume
        order = [(first + j) % workers for j in range(workers)]
        streams = {w: self._stream(epoch, w, workers, skips[w]) for w in order}
        while streams:
            for w in order:
                if w not in streams:
                    continue
                batch = list(itertools.islice(streams[w], batch_size or 1))
                if not batch or (drop_last and batch_size and len(batch) < batch_size):
                    del streams[w]
                    continue
                yield batch if batch_size else batch[0]


def _takes_range(fn) -> bool:
    """`read_shard(path, start, stop)`: a second and third positional parameter, required or
    named `start` and `stop` (a reader's optional settings in those places are not a range)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and all(p.default is p.empty or p.name == name
                                    for p, name in zip(params[1:3], ("start", "stop"), strict=True))

