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

Who reads what (whole shards or sample ranges, `even`, node-affine with a cache per node) is
`shard_plan.py`'s. A resume on another number of ranks or nodes deals what no rank received
over the new ones (`shard_reshape.py`); `even` then repeats at most `world_size - 1` again.
Copy with: common/caches/packed_strings.py, common/sampling/sharding.py,
  common/shards/shard_mixing.py, common/shards/shard_plan.py, common/shards/shard_reading.py,
  common/shards/shard_reshape.py.
"""

from __future__ import annotations

import copy
import itertools
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.sampling.sharding import (
    Piece,
    distributed_world,
    fragment_pieces,
    round_robin_position,
)
from recipes.common.shards.shard_mixing import INTERLEAVE, ORDER_VERSION, START, WINDOW, need_order
from recipes.common.shards.shard_plan import ShardPlan
from recipes.common.shards.shard_reading import ShardReading, takes_range
from recipes.common.shards.shard_reshape import consumer_ranges, rest_fragments


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
            its place in the shuffled shard order; 0: shard order only. About this many shards
            are read at random at once: with a `cache`, give it `max_bytes` of about 2 x window x
            workers x shard size per node (less costs downloads again).
        blocks: where a shard may be cut for mixing: an int (every `blocks` samples) or
            `blocks(shard) -> ascending sample indices` (the first 0), each block read whole in
            one `read_shard(path, start, stop)` call when first drawn (memory: `INTERLEAVE`
            blocks). Default: single samples with a ranged `read_shard`; a reader without
            ranges does not mix unless given `blocks` (each block then reads past its start).
        rank, world_size: this rank and the number of ranks; `torch.distributed`'s when
            initialised at construction, else 0 and 1.
        cache: a `PrefetchCache` to download remote shards ahead of reading. With one per node
            on several nodes (torchrun's `LOCAL_WORLD_SIZE` ranks each), the plan is node-affine:
            each node reads the same shards every epoch (`shard_plan.py`).
        shard_sha256: each shard's sha256, when known: the cache verifies its copies with it
            (a damaged copy, or one of an older version of the shard, is downloaded again).
        split: "auto" (the rule of the module docstring) or "samples": sample ranges of the
            epoch's concatenated shards whatever the shard count (needs `shard_lengths`): with
            `even` every sample once per epoch and at most `world_size - 1` repeat, where whole
            shards skip the surplus of the ranks with more samples.

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
            raise ValueError(
                f"`shuffle_window` must be a non-negative int, but is {shuffle_window!r} instead."
            )
        if isinstance(blocks, int) and blocks < 1:
            raise ValueError(
                f"`blocks` must be a positive int or a callable, but is {blocks!r} instead."
            )
        self.shuffle_window = shuffle_window
        self.blocks = blocks
        if split not in ("auto", "samples"):
            raise ValueError(f"`split` must be 'auto' or 'samples', but is {split!r} instead.")
        if split == "samples" and shard_lengths is None:
            raise ValueError(
                "split='samples' needs `shard_lengths` (the samples per shard) to cut sample "
                "ranges."
            )
        self.split = split
        self.shard_sha256 = None if shard_sha256 is None else list(shard_sha256)
        self.shards = PackedStrings(shards)
        if len(self.shards) == 0:
            raise ValueError("`shards` is empty; pass at least one shard.")
        self.read_shard = read_shard
        self.shard_lengths = (
            None if shard_lengths is None else np.asarray(shard_lengths, dtype=np.int64)
        )
        if self.shard_lengths is not None and (
            self.shard_lengths.shape != (len(self.shards),) or (self.shard_lengths < 0).any()
        ):
            raise ValueError(
                f"`shard_lengths` must hold one non-negative count per shard ({len(self.shards)})."
            )
        world, here = distributed_world()
        self.world_size = world if world_size is None else world_size
        self.rank = here if rank is None else rank
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"`rank` must be in [0, {self.world_size}), but is {self.rank!r} instead."
            )
        if even and self.world_size > 1 and self.shard_lengths is None:
            raise ValueError(
                "even=True under DDP needs `shard_lengths` to give every rank the same number of "
                "samples; pass shard_lengths= (or even=False if your loop tolerates uneven ranks)."
            )
        self.shuffle = shuffle
        self.seed = seed
        self.even = even
        self.cache = cache
        # node-affine with a cache (one per node): the nodes of torchrun's LOCAL_WORLD_SIZE ranks
        # each
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.nodes = (
            self.world_size // per_node
            if cache is not None
            and shuffle
            and self.shard_lengths is not None
            and per_node
            and self.world_size % per_node == 0
            else 1
        )
        self._ranged = takes_range(read_shard)
        self._epoch = torch.zeros(
            1, dtype=torch.int64
        ).share_memory_()  # reaches persistent workers
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
        read first this epoch, in the order the DataLoader needs them (each worker's first, then
        each one's second, ...), up to `max(cache.prefetch, num_workers)` shards; the workers
        find them in place or in flight (the cache's per-key lock). `num_workers`: the
        DataLoader's (`make_loader`'s loader passes it), else the count the workers reported
        last epoch, else one. Returns the futures."""
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
        return self.cache.prefetch(
            list(firsts)[: max(self.cache.depth, workers) * (2 if self.mixes else 1)]
        )

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def plan_settings(self) -> dict:
        """Every setting that shapes an epoch's plan, as JSON (not the ranks: a resume may
        change them); a loader state carries it and refuses to resume under others."""
        if getattr(self, "_shards_crc", None) is None:
            data = self.shards.data.tobytes() + self.shards.offsets.tobytes()
            lengths = b"" if self.shard_lengths is None else self.shard_lengths.tobytes()
            self._shards_crc = (
                f"{zlib.crc32(data):08x}",
                None if self.shard_lengths is None else f"{zlib.crc32(lengths):08x}",
            )
        settings = {
            "num_shards": len(self.shards),
            "shards": self._shards_crc[0],
            "shard_lengths": self._shards_crc[1],
            "shuffle": self.shuffle,
            "seed": self.seed,
            "even": self.even,
        }
        if self.split != "auto":  # states saved before `split` existed still match "auto"
            settings["split"] = self.split
        if self.mixes:  # the sample order (states of shard-order reading do not match)
            settings["mixing"] = {
                "order": ORDER_VERSION,
                "window": self.shuffle_window,
                "start": START,
                "interleave": INTERLEAVE,
                "blocks": self._blocks_key(),
            }
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
        return self._rules().order(epoch)

    def plan(self, epoch: int, worker: int = 0, num_workers: int = 1) -> list[Piece]:
        """The pieces (shard, start, stop) that consumer (self.rank, worker) reads in `epoch`: of
        the epoch's shards (`shard_plan.py`), or of an elastic resume's rest (`resume_after`)."""
        rest = getattr(self, "_rest", None)
        if rest is not None and rest[0] == epoch:
            return fragment_pieces(
                rest[2],
                rank=self.rank,
                world_size=self.world_size,
                worker=worker,
                num_workers=num_workers,
                even=self.even,
            )
        return self._rules().pieces(
            epoch,
            rank=self.rank,
            world_size=self.world_size,
            worker=worker,
            num_workers=num_workers,
        )

    def _rules(self) -> ShardPlan:
        return ShardPlan(
            len(self.shards),
            self.shard_lengths,
            self.shuffle,
            self.seed,
            self.even,
            self.split,
            self.nodes,
        )

    # ---- resuming ----------------------------------------------------------------------
    @property
    def reshapes(self) -> bool:
        """Whether a resume on another shape deals the epoch's rest over the new ranks and workers
        (`resume_after(reshaped=)`, with `shard_lengths`); else new ranks replay old ranks' rests.
        """
        return self.shard_lengths is not None

    def resume_after(
        self,
        batches_done: int,
        *,
        batch_size: int | None,
        drop_last: bool = False,
        num_workers: int = 0,
        interleave: bool = False,
        world_size: int | None = None,
        reshaped: Sequence[Sequence[int]] | None = None,
    ) -> ShardedIterableDataset:
        """A copy whose next epoch starts after the first `batches_done` batches that a
        DataLoader with these settings yields (`StatefulLoader` calls it).

        DataLoader yields the workers' batches round-robin, skipping a worker once it is
        exhausted; each worker works out from the plan how many of the first `batches_done`
        were its own and starts after them, the roles rotated so that the worker due next comes
        first (without `shard_lengths` and with several workers, by reading the epoch's first
        `batches_done` batches). `interleave=True` (the resuming loader has another worker
        count) yields the rest of the epoch in one process, as whole batches (lists) in the old
        order: read it with `batch_size=None` and the old collate function.

        Elastic without `shard_lengths`: `world_size`, the interrupted epoch's ranks (each had
        done `batches_done`); this rank replays in-process the rests of the old ranks `r` with
        `r % world_size == rank` (the new ranks stay equal when the new count divides the old).

        Reshaped (`reshapes`): `reshaped` lists the epoch's earlier shapes `(ranks, workers,
        batches each rank received, nodes)`, oldest first; the copy's epoch is what no rank received
        in them (`shard_reshape.py`), split and mixed over these ranks and `num_workers` workers as
        an epoch is (`even`: at most `world_size - 1` repeat); `batches_done` counts this shape's.
        """
        resumed = copy.copy(self)
        if reshaped:
            resumed._rest = (
                self.epoch,
                len(reshaped),
                self._rest_fragments(self.epoch, reshaped, batch_size, drop_last),
            )
        if world_size is not None and world_size != self.world_size:
            if world_size <= 0:
                raise ValueError(f"`world_size` must be positive, but is {world_size!r} instead.")
            interleave = True
        resumed._resume = (
            int(batches_done),
            batch_size,
            bool(drop_last),
            max(1, int(num_workers)),
            interleave,
        )
        resumed._resume_world = world_size if world_size is not None else self.world_size
        return resumed

    def _resume_position(self, epoch: int) -> tuple[list[int], int]:
        """`(samples each worker skips, the worker that yields the next batch)` of a resume."""
        done, batch_size, drop_last, workers, _ = self._resume
        per_batch = 1 if batch_size is None else batch_size
        batches = []
        for w in range(workers):
            n = self._plan_samples(self.plan(epoch, w, workers))
            batches.append(
                None if n is None else (n // per_batch if drop_last else -(-n // per_batch))
            )
        if (
            None in batches
        ):  # unknown lengths: one worker made every batch; several may have run out
            return (
                ([done * per_batch], 0)
                if workers == 1
                else self._replayed_position(epoch, done, per_batch, drop_last, workers)
            )
        skipped, first = round_robin_position(batches, done)
        return [s * per_batch for s in skipped], first

    def _replayed_position(
        self, epoch: int, done: int, per_batch: int, drop_last: bool, workers: int
    ) -> tuple[list[int], int]:
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

    def _rest_fragments(
        self, epoch: int, segments, batch_size: int | None, drop_last: bool
    ) -> np.ndarray:
        """What no consumer received in the epoch's earlier `segments` (`resume_after`)."""
        rest = None
        for generation, (world, workers, batches, *nodes) in enumerate(segments):
            consumers = []
            workers = max(1, int(workers))
            for rank in range(int(world)):
                former = copy.copy(self)
                former.rank = rank
                former.world_size = int(world)
                former._resume_world = int(world)
                former.nodes = int(nodes[0]) if nodes else 1
                former._rest = None if rest is None else (epoch, generation, rest)
                former._resume = (int(batches), batch_size, bool(drop_last), workers, False)
                for w, skip in enumerate(former._resume_position(epoch)[0]):
                    pieces = [
                        (a, b, int(self.shard_lengths[a]) if c is None else c)
                        for a, b, c in former.plan(epoch, w, workers)
                    ]
                    mixing = (
                        former._schedule(epoch, w, workers, pieces, draws_needed=skip)
                        if former.mixes
                        else None
                    )
                    consumers.append(consumer_ranges(pieces, mixing, skip))
            rest = rest_fragments(self.shard_lengths, self.order(epoch), consumers)
        return rest

    def _mixing(self, epoch: int, worker: int) -> dict:
        """The mixing's seed (and in an elastic resume's rest the samples a piece stands for)."""
        rest = getattr(self, "_rest", None)
        if rest is not None and rest[0] == epoch:
            return {
                "seed": (self.seed, epoch, self.rank, worker, rest[1]),
                "piece": float(self.shard_lengths.mean()) if len(self.shard_lengths) else None,
            }
        return {"seed": (self.seed, epoch, self.rank, worker)}

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
        if (
            old_world != self.world_size
        ):  # other ranks than the interrupted epoch: replay their rests
            for old_rank in range(self.rank, old_world, self.world_size):
                former = copy.copy(self)
                former.rank = old_rank
                former.world_size = old_world
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
        upcoming = (
            (lambda: self.plan(epoch + 1, worker, num_workers)) if self.cache is not None else list
        )
        reading = self._reading()
        if self.mixes:
            yield from reading.mixed(pieces, skip, upcoming, **self._mixing(epoch, worker))
        else:
            yield from reading.in_order(pieces, skip, upcoming)

    @property
    def mixes(self) -> bool:
        """Whether samples mix (`shuffle` with a window, `shard_lengths`, and a ranged `read_shard`
        or explicit `blocks`); otherwise each shard is read front to back."""
        return bool(
            self.shuffle
            and self.shuffle_window
            and self.shard_lengths is not None
            and (self._ranged or self.blocks is not None)
        )

    def _reading(self) -> ShardReading:
        return ShardReading(
            self.shards,
            self.read_shard,
            self._ranged,
            self.shard_lengths,
            self.cache,
            self.shard_sha256,
            self.blocks,
            self.shuffle_window,
        )

    def _schedule(
        self,
        epoch: int,
        worker: int,
        num_workers: int = 1,
        pieces: list[Piece] | None = None,
        draws_needed=None,
    ):
        pieces = self.plan(epoch, worker, num_workers) if pieces is None else pieces
        return self._reading().schedule(
            pieces, **self._mixing(epoch, worker), draws_needed=draws_needed
        )

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
