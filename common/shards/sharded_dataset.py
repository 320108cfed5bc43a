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
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

import recipes.common.shards.epochs.plan_settings as keys
from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.sampling.sharding import Piece, distributed_world
from recipes.common.shards.epochs.epoch_resume import (
    ConsumedShape,
    ResumePoint,
    rest_after,
    rest_after_consumed,
    resumed_samples,
)
from recipes.common.shards.epochs.plan_settings import (
    blocks_crc,
    lengths_crc,
    mixing_settings,
    shards_crc,
    versions_crc,
)
from recipes.common.shards.epochs.rank_epoch import EpochRest, RankEpoch
from recipes.common.shards.epochs.shard_mixing import WINDOW, need_order
from recipes.common.shards.epochs.shard_plan import ShardPlan
from recipes.common.shards.epochs.shard_reading import ShardReading, takes_range


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
        shard_versions: each shard's version (an ETag, a sha256), when known: part of the
            plan's settings, so a state saved before a shard was rewritten is refused.
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
        shard_versions: Sequence[str | None] | None = None,
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
        self.shard_sha256 = None
        if shard_sha256 is not None:
            self.shard_sha256 = list(shard_sha256)
        self.shard_versions = None
        if shard_versions is not None:
            self.shard_versions = list(shard_versions)
        self.shards = PackedStrings(shards)
        if len(self.shards) == 0:
            raise ValueError("`shards` is empty; pass at least one shard.")
        self.read_shard = read_shard
        self.shard_lengths = None
        if shard_lengths is not None:
            self.shard_lengths = np.asarray(shard_lengths, dtype=np.int64)
            if self.shard_lengths.shape != (len(self.shards),) or (self.shard_lengths < 0).any():
                raise ValueError(
                    "`shard_lengths` must hold one non-negative count per shard "
                    f"({len(self.shards)})."
                )
        world, here = distributed_world()
        self.world_size = world_size
        if world_size is None:
            self.world_size = world
        self.rank = rank
        if rank is None:
            self.rank = here
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
        self.nodes = self._node_count()
        self._ranged = takes_range(read_shard)
        # in shared memory: reaches persistent workers
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._workers_seen = torch.zeros(1, dtype=torch.int64).share_memory_()  # written by workers
        self._resume: ResumePoint | None = None  # set by `resume_after` on its copy
        self._rest: EpochRest | None = None  # an elastic resume's rest of the epoch
        self._shards_crc: str | None = None  # `plan_settings`' checksums, computed once
        self._blocks_crc: str | None = None

    def _node_count(self) -> int:
        """Node-affine with a cache (one per node): the nodes of torchrun's `LOCAL_WORLD_SIZE`
        ranks each; else 1."""
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if self.cache is None or not self.shuffle or self.shard_lengths is None or not per_node:
            return 1
        if self.world_size % per_node:
            return 1
        return self.world_size // per_node

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
        if self.cache is None or self._resume is not None:  # a resume reads another order
            return []
        workers = num_workers or int(self._workers_seen.item())
        consumers = max(workers, 1)
        reads = self._reads()
        orders = []
        for w in range(consumers):
            if self.mixes:  # the order the mixed draws first need them
                orders.append(need_order(reads.schedule(self.epoch, w, consumers)))
            else:
                orders.append([piece[0] for piece in reads.pieces(self.epoch, w, consumers)])
        rounds = itertools.zip_longest(*orders)
        firsts = dict.fromkeys(self.shards[s] for r in rounds for s in r if s is not None)
        ahead = max(self.cache.depth, workers)
        if self.mixes:
            ahead *= 2
        return self.cache.prefetch(list(firsts)[:ahead])

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def plan_settings(self) -> dict:
        """Every setting that shapes an epoch's plan, as JSON (not the ranks: a resume may
        change them); a loader state carries it and refuses to resume under others."""
        if self._shards_crc is None:
            self._shards_crc = shards_crc(self.shards)
        settings = {
            keys.NUM_SHARDS: len(self.shards),
            keys.SHARDS: self._shards_crc,
            keys.SHARD_LENGTHS: lengths_crc(self.shard_lengths),
            keys.SHUFFLE: self.shuffle,
            keys.SEED: self.seed,
            keys.EVEN: self.even,
        }
        if self.shard_versions is not None:
            settings[keys.SHARD_VERSIONS] = versions_crc(self.shard_versions)
        if self.split != "auto":  # states saved before `split` existed still match "auto"
            settings[keys.SPLIT] = self.split
        if self.mixes:  # the sample order (states of shard-order reading do not match)
            settings[keys.MIXING] = mixing_settings(self.shuffle_window, self._blocks_key())
        return settings

    def _blocks_key(self):
        """`blocks` as it shapes the order: an int or None as it is; a callable by a checksum of
        the cuts it gives for every shard (`plan_settings.blocks_crc`)."""
        if self.blocks is None or isinstance(self.blocks, int):
            return self.blocks
        if self._blocks_crc is None:
            self._blocks_crc = blocks_crc(self.blocks, len(self.shards))
        return self._blocks_crc

    # ---- the plan ----------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        """Shard indices in the order of `epoch`."""
        return self._rules().order(epoch)

    def plan(self, epoch: int, worker: int = 0, num_workers: int = 1) -> list[Piece]:
        """The pieces (shard, start, stop) that consumer (self.rank, worker) reads in `epoch`: of
        the epoch's shards (`shard_plan.py`), or of an elastic resume's rest (`resume_after`)."""
        return self._reads().pieces(epoch, worker, num_workers)

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

    def _reads(self) -> RankEpoch:
        """This rank's reads (`rank_epoch.py`): the plan, the reading and the rest, if any."""
        reading = ShardReading(
            self.shards,
            self.read_shard,
            self._ranged,
            self.shard_lengths,
            self.cache,
            self.shard_sha256,
            self.blocks,
            self.shuffle_window,
        )
        return RankEpoch(
            self._rules(), reading, self.rank, self.world_size, self.mixes, rest=self._rest
        )

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

    # ---- resuming (`epoch_resume.py`) ----------------------------------------------------
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
            fragments = rest_after(self._reads(), self.epoch, reshaped, batch_size, drop_last)
            resumed._rest = EpochRest(self.epoch, len(reshaped), fragments)
        old_world = self.world_size
        if world_size is not None and world_size != self.world_size:
            if world_size <= 0:
                raise ValueError(f"`world_size` must be positive, but is {world_size!r} instead.")
            interleave = True
            old_world = world_size
        resumed._resume = ResumePoint(
            int(batches_done),
            batch_size,
            bool(drop_last),
            max(1, int(num_workers)),
            interleave,
            old_world,
        )
        return resumed

    def resume_consumed(self, shapes: Sequence[Sequence]) -> ShardedIterableDataset:
        """A copy whose epoch is what no consumer received over the epoch's earlier `shapes`
        (oldest first; each a `ConsumedShape` or its fields `(ranks, workers, received[rank]
        [worker], nodes)`), given as the samples each consumer (rank, worker) received rather
        than a loader's batches (a `MixtureIterable` counts its own sources'), dealt over this
        dataset's ranks and its loader's workers as an epoch is. Needs `shard_lengths`."""
        if self.shard_lengths is None:
            raise ValueError("resume_consumed needs `shard_lengths` (the rest is counted in them).")
        resumed = copy.copy(self)
        resumed._resume = None
        resumed._rest = None
        if shapes:
            consumed = [ConsumedShape(*shape) for shape in shapes]
            fragments = rest_after_consumed(self._reads(), self.epoch, consumed)
            resumed._rest = EpochRest(self.epoch, len(shapes), fragments)
        return resumed

    def consumer_lengths(self, rank: int, ranks: int, *, workers: int) -> np.ndarray:
        """The samples each worker of `rank` (of `ranks` x `workers`) reads this epoch (or this
        copy's rest of it): int64 `[workers]`. Needs `shard_lengths`."""
        reads = self._reads().for_rank(rank, ranks)
        counts = [reads.samples_in(reads.pieces(self.epoch, w, workers)) for w in range(workers)]
        return np.asarray(counts, dtype=np.int64)

    def consumer_samples(
        self, rank: int, ranks: int, *, worker: int, workers: int, skip: int = 0
    ) -> Iterator:
        """The samples consumer (rank, worker) of `ranks` x `workers` reads this epoch (or this
        copy's rest of it), after its first `skip` (not read)."""
        return self._reads().for_rank(rank, ranks).stream(self.epoch, worker, workers, skip)

    # ---- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker = 0
        num_workers = 1
        if info is not None:
            worker = info.id
            num_workers = info.num_workers
        self._workers_seen.fill_(num_workers)
        epoch = self.epoch
        if self._resume is None:
            yield from self._reads().stream(epoch, worker, num_workers)
            return
        yield from resumed_samples(self._reads(), epoch, self._resume, worker)
