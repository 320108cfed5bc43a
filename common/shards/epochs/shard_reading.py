"""`ShardReading`: how one consumer (rank x worker) reads its pieces of an epoch's shards.

Use when: `ShardedIterableDataset` has its plan (the pieces `(shard, start, stop)` this consumer
reads) and needs the samples: in order (each piece front to back) or mixed (the order of
`shard_mixing.mixing_schedule`), through a `PrefetchCache` when there is one.
Cost: in order, one `read_shard` call per piece; mixed, one per block (a sample of a tar, a row
group of a Parquet file), its shard pinned in the cache only meanwhile; downloads run
`cache.depth` shards ahead in the order the samples need them.
Adapt here: nothing; the dataset sets every field.
Trade-off: a mixed block is read whole when first drawn (memory: `INTERLEAVE` blocks), so a
reader's lazy iteration within a block is not kept.
Copy with: common/caches/packed_strings.py, common/sampling/sharding.py,
  common/shards/epochs/shard_mixing.py."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.sampling.sharding import Piece
from recipes.common.shards.epochs.shard_mixing import mixed_samples, mixing_schedule, need_order


@dataclass(frozen=True)
class ShardReading:
    """The dataset's reading settings: its shards, reader, lengths, cache and mixing."""

    shards: PackedStrings
    read_shard: Callable[..., Iterable]
    ranged: bool
    shard_lengths: np.ndarray | None
    cache: Any
    shard_sha256: Sequence[str] | None
    blocks: Any
    window: int

    def in_order(self, pieces: list[Piece], skip: int, upcoming: Callable[[], list]) -> Iterator:
        """The pieces one after another, each front to back, after the first `skip` samples."""
        after = list(pieces)
        if self.cache is not None:
            after += upcoming()
        for k, (shard, start, stop) in enumerate(pieces):
            if skip:
                length = self._length(shard, start, stop)
                if length is not None and length <= skip:
                    skip -= length
                    continue
                if length is not None:
                    start = start + skip
                    skip = 0
            if self.cache is not None:  # the next shards, then the next epoch's first ones
                self.cache.prefetch(
                    self.shards[s] for s, _, _ in after[k + 1 : k + 1 + self.cache.depth]
                )
            items = self.read(shard, start, stop)
            if skip:  # a piece of unknown length: read past what was done
                items, skip = drop(items, skip)
            elif self.ranged and self._length(shard, start, stop) is not None:
                items = self._counted(items, shard, start, self._length(shard, start, stop))
            yield from items

    def _counted(self, items: Iterable, shard: int, start: int, want: int) -> Iterator:
        """A ranged read's samples, refusing more or fewer than its range (a reader that ignores
        `start`/`stop` would repeat samples silently)."""
        got = 0
        for item in items:
            got += 1
            if got > want:
                break
            yield item
        if got != want:
            gave = got
            if got > want:
                gave = "more"
            raise ValueError(
                f"read_shard({self.shards[shard]!r}, {start}, {start + want}) gave "
                f"{gave} samples where the range holds {want} "
                "(`shard_lengths` says how many each shard holds): a stale length, or a reader "
                "that ignores `start`/`stop`?"
            )

    def schedule(
        self,
        pieces: list[Piece],
        *,
        seed: Sequence[int],
        piece: float | None = None,
        draws_needed: int | None = None,
    ):
        pieces = [(shard, start, self._stop(shard, stop)) for shard, start, stop in pieces]
        return mixing_schedule(
            pieces,
            block_starts=self.block_starts,
            seed=seed,
            window=self.window,
            piece_samples=piece,
            draws_needed=draws_needed,
        )

    def mixed(
        self,
        pieces: list[Piece],
        skip: int,
        upcoming: Callable[[], list],
        *,
        seed: Sequence[int],
        piece: float | None = None,
    ) -> Iterator:
        """The samples in the order of `mixing_schedule`, after the first `skip`; with a cache,
        each shard new to the epoch starts the downloads of the next ones."""
        schedule = self.schedule(pieces, seed=seed, piece=piece)
        if self.cache is None:
            yield from mixed_samples(schedule, skip, self.read_block)
            return
        order = need_order(schedule, skip)
        pins = _Pins(self, schedule, skip)
        try:
            yield from mixed_samples(
                schedule,
                skip,
                pins.read_block,
                lambda at: self._prefetch_after(at, order, upcoming),
            )
        finally:
            pins.close()

    def read_block(self, shard: int, start: int, stop: int, path=None) -> list:
        """The samples `[start, stop)` of `shard` (from `path`, a pinned copy, if given; else
        pinned meanwhile), reversed (taken from the end with `pop`)."""
        with contextlib.ExitStack() as held:
            if path is None:
                path = self.pinned_path(shard, held)
            items = list(self._read_path(path, start, stop))
        if len(items) != stop - start:
            raise ValueError(
                f"read_shard({self.shards[shard]!r}, {start}, {stop}) gave {len(items)} samples "
                f"where the range holds {stop - start} (`shard_lengths` says how many each shard "
                "holds): a stale length, or a reader that ignores `start`/`stop`?"
            )
        items.reverse()
        return items

    def read(self, shard: int, start: int, stop: int | None) -> Iterator:
        with contextlib.ExitStack() as held:
            yield from self._read_path(self.pinned_path(shard, held), start, stop)

    def block_starts(self, shard: int) -> np.ndarray:
        if callable(self.blocks):
            return np.asarray(self.blocks(shard), dtype=np.int64)
        size = self.blocks
        if size is None and not self.ranged:
            # whole pieces: a reader without ranges reads from the shard's start
            return np.zeros(1, dtype=np.int64)
        if size is None:
            size = 1
        return np.arange(0, int(self.shard_lengths[shard]), size, dtype=np.int64)

    def _prefetch_after(self, at: int, order: list[int], upcoming) -> None:
        """Starts the downloads of the `cache.depth` shards needed after the `at`-th (then the
        next epoch's first ones): no further, so that downloads ahead do not evict what is still
        to be read."""
        ahead = order[at + 1 : at + 1 + self.cache.depth]
        if len(ahead) < self.cache.depth:
            ahead += [s for s, _, _ in upcoming()[: self.cache.depth - len(ahead)]]
        if ahead:
            self.cache.prefetch(self.shards[s] for s in ahead)

    def _length(self, shard: int, start: int, stop: int | None) -> int | None:
        if stop is None:
            if self.shard_lengths is None:
                return None
            stop = int(self.shard_lengths[shard])
        return stop - start

    def _stop(self, shard: int, stop: int | None) -> int:
        """A piece's stop, known (`None`: the end of the shard)."""
        if stop is None:
            return int(self.shard_lengths[shard])
        return stop

    def pinned_path(self, shard: int, held: contextlib.ExitStack):
        """Where to read `shard` from: its URL, or its copy in the cache, pinned until `held`
        closes."""
        url = self.shards[shard]
        if self.cache is None:
            return url
        sha256 = None
        if self.shard_sha256 is not None:
            sha256 = self.shard_sha256[shard]
        return held.enter_context(self.cache.pinned(url, sha256=sha256))

    def _read_path(self, path, start: int, stop: int | None) -> Iterable:
        if self.ranged:
            return self.read_shard(path, start, stop)
        if start or stop is not None:
            return itertools.islice(self.read_shard(path), start, stop)
        return self.read_shard(path)


class _Pin(NamedTuple):
    """A cached copy held pinned: the stack that releases it, its path and its size."""

    stack: contextlib.ExitStack
    path: object
    size: int


class _Pins:
    """Cached copies held pinned while the mixed draws still need them (each shard's last block
    releases it), within a share of the cache: `max_bytes / (4 x workers x local ranks)` per
    consumer, and only while the cache is at most half full (processes this one cannot count,
    such as ranks without `LOCAL_WORLD_SIZE` or other jobs, share it too); otherwise a shard is
    pinned only while a block of it is read (a pin per sample costs a lock, a stat and a
    timestamp: 10-20% of a cached epoch's rate)."""

    def __init__(self, reading: ShardReading, schedule, skip: int):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        if info is not None:
            sharing *= info.num_workers
        self.reading = reading
        self.budget = reading.cache.max_bytes // (4 * max(1, sharing))
        blocks = np.unique(schedule.draws[skip:])
        shards, counts = np.unique(schedule.shards[blocks], return_counts=True)
        self.left = dict(
            zip(shards.tolist(), counts.tolist(), strict=True)
        )  # blocks still to read per shard
        self.held: dict[int, _Pin] = {}
        self.bytes = 0

    def read_block(self, shard: int, start: int, stop: int) -> list:
        self.left[shard] -= 1
        if (
            shard not in self.held
            and self.left[shard] > 0
            and self.bytes < self.budget
            and self.reading.cache.used_bytes() <= self.reading.cache.max_bytes // 2
        ):  # room to spare
            stack = contextlib.ExitStack()
            path = self.reading.pinned_path(shard, stack)
            size = _file_size(path)
            if self.bytes + size <= self.budget:
                self.held[shard] = _Pin(stack, path, size)
                self.bytes += size
            else:
                stack.close()
        pin = self.held.get(shard)
        if pin is None:
            return self.reading.read_block(shard, start, stop)
        items = self.reading.read_block(shard, start, stop, path=pin.path)
        if not self.left[shard]:
            self._release(shard)
        return items

    def _release(self, shard: int) -> None:
        pin = self.held.pop(shard)
        self.bytes -= pin.size
        pin.stack.close()

    def close(self) -> None:
        for shard in list(self.held):
            self._release(shard)


def _file_size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def drop(items: Iterator, count: int) -> tuple[Iterator, int]:
    """`items` after its first `count`, and how many of `count` it could not supply."""
    items = iter(items)
    for dropped in range(count):
        if next(items, _END) is _END:
            return iter(()), count - dropped
    return items, 0


_END = object()


def takes_range(fn) -> bool:
    """`read_shard(path, start, stop)`: a second and third positional parameter, required or
    named `start` and `stop` (a reader's optional settings in those places are not a range)."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and all(
        p.default is p.empty or p.name == name
        for p, name in zip(params[1:3], ("start", "stop"), strict=True)
    )
