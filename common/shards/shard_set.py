"""`ShardSet`: shards in open formats (WebDataset tar, Parquet), local or on object storage, read
back.

Use when: a dataset lives in a few large files on S3/GCS/HTTP or a shared disk and must be read
exactly once per epoch over ranks and workers:
`ShardSet.open(url).dataset(cache=PrefetchCache(...))` reads them as a `ShardedIterableDataset`;
`shard_writer.py` writes them (`write_shards`) or indexes shards other tools wrote (`index_shards`:
`webdataset.ShardWriter`, Parquet exports).
Cost: fetches the index once, then each consumer's shards (or sample ranges: tar member
offsets, Parquet row groups).
Adapt here: nothing; the index's name is `shard_index.INDEX_NAME`.
Trade-off: what is served is checked against the index on every path (local, cached, streamed,
ranged); a v1 index (no checksums) is read unverified.

The index (`index.json`, JSON, version 2) per shard: its name, sample count, byte size, sha256
and, for tar, each sample's first header offset, the end of its last sample and each sample's
xxh3-64; for Parquet, rows per row group and an xxh3-64 per row group and column. Every read checks
what it serves against it (see `recipes.common.shards.shard_checks`; the index's own checks:
`shard_index.py`); v1 indexes read, unverified.
Copy with: common/caches/cache_folder.py, common/caches/packed_strings.py,
  common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_formats.py, common/shards/shard_index.py, common/shards/shard_samples.py,
  common/shards/sharded_dataset.py, common/shards/tar_members.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from recipes.common.shards.epochs.shard_mixing import WINDOW
from recipes.common.shards.shard_checks import (
    check_local_shard,
    counted,
    parquet_group_check,
    tar_range_check,
)
from recipes.common.shards.shard_formats import (
    read_parquet,
    read_tar,
)
from recipes.common.shards.shard_index import (
    INDEX_NAME,
    SUMS,
    VERSION,
    ShardIndexError,
    check_index,
    check_versioned,
)
from recipes.common.shards.shard_samples import (
    ShardFormatError,
    decode_sample,
)
from recipes.common.shards.sharded_dataset import ShardedIterableDataset

__all__ = ["ShardFormatError", "ShardIndexError", "ShardSet"]

STREAM_BLOCK_BYTES = (
    4 * 2**20
)  # a ranged request per block when streaming: latency amortised over ~4 MiB


class ShardSet:
    """The shards under a URL and their index (`write_shards` or `index_shards` wrote it).

    Attributes:
        url: the folder or URL; `urls`: each shard's URL; `lengths`: samples per shard;
        `format`: "tar" or "parquet"; `entries`: the index's per-shard records.
    """

    def __init__(self, url: str, index: dict, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.format = index["shard_format"]
        self.entries = index["shards"]
        self.urls = [f"{self.url}/{e['name']}" for e in self.entries]
        self.lengths = np.array([e["samples"] for e in self.entries], dtype=np.int64)
        self.columns = index.get("columns")
        # per shard, its samples' xxh3-64s (tar) or its row groups' x columns' (Parquet); None for a
        # v1 index (its samples are not checked byte for byte)
        self.checksums = None
        if index.get("version", VERSION) >= 2:
            self.checksums = [np.array(e[SUMS], dtype=np.uint64) for e in self.entries]

    @classmethod
    def open(cls, url: str | os.PathLike, storage_options: dict | None = None) -> ShardSet:
        """Reads `url`'s index.

        Raises:
            ShardIndexError: no index (never written, or its writer was killed), or a damaged one.
        """
        import fsspec

        url = os.fspath(url).rstrip("/")
        path = f"{url}/{INDEX_NAME}"
        try:
            with fsspec.open(path, "rb", **(storage_options or {})) as f:
                index = json.loads(f.read())
        except FileNotFoundError:
            raise ShardIndexError(
                f"{path} does not exist: write the shards with write_shards(), or index shards "
                "written by another tool with index_shards() (`recipes shards index`)."
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            raise ShardIndexError(
                f"{path} is damaged ({error}); rebuild it with index_shards()."
            ) from None
        check_index(index, path)
        check_versioned(index, path)
        return cls(url, index, storage_options)

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def __repr__(self) -> str:
        return (
            f"ShardSet({self.url!r}, {self.format}, {len(self.entries)} shards, "
            f"{len(self)} samples)"
        )

    def read(
        self,
        shard: int,
        start: int = 0,
        stop: int | None = None,
        *,
        path: str | None = None,
        decode: bool = True,
        columns: Sequence[str] | None = None,
        verified: bool = False,
    ):
        """The samples `[start, stop)` of shard `shard`, from `path` (a local copy) or its URL.
        A local file is checked against the index first (size, and sha256 once per process and
        file version, unless `verified`: a copy `PrefetchCache.get(url, sha256=)` checked);
        any read must yield the samples the index promises.

        Every sample is checked against the index's checksums (xxh3-64) before it is yielded (a v2
        index), on every path: a local file, a cached copy, a remote object read by ranges.

        Raises:
            ShardFormatError: a shard that differs from its index (damaged, or rewritten since
                the index was read: its size, sha256, a sample's checksum, offset or count), or a
                field that does not decode (naming the key and the field).
            ShardIndexError: (a ShardFormatError) a tar offset of the range that starts no key's
                header.
        """
        entry = self.entries[shard]
        source = self.urls[shard]
        options = self.storage_options
        if path is not None:  # a local copy
            source = path
            options = None
        local = "://" not in str(source) or str(source).startswith("file://")
        if local:
            check_local_shard(
                str(source).removeprefix("file://"), entry, self.urls[shard], hash=not verified
            )
        url = self.urls[shard]
        crcs = None
        if self.checksums is not None:
            crcs = self.checksums[shard]
        if self.format == "tar":
            offsets = entry.get("offsets")
            check = None
            if offsets is not None:
                check = tar_range_check(url, offsets, entry.get("end"), crcs, start, stop)
            items = read_tar(
                source,
                start,
                stop,
                offsets=offsets,
                end=entry.get("end"),
                check=check,
                storage_options=options,
            )
        else:
            group_crcs = None
            if crcs is not None:
                group_crcs = crcs.tolist()
            check = parquet_group_check(url, self.columns, group_crcs)
            items = read_parquet(
                source,
                start,
                stop,
                columns=columns,
                row_groups=entry["row_groups"],
                check=check,
                storage_options=options,
            )
        if decode:
            items = (decode_sample(sample, url) for sample in items)
        end = int(entry["samples"])
        if stop is not None:
            end = min(end, stop)
        return counted(items, max(0, end - start), url)

    def dataset(
        self,
        *,
        cache=None,
        shuffle: bool = True,
        seed: int = 0,
        even: bool = True,
        split: str = "samples",
        decode: bool = True,
        columns: Sequence[str] | None = None,
        transform=None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_window: int = WINDOW,
    ) -> ShardedIterableDataset:
        """A `ShardedIterableDataset` over the shards: the epoch's shuffled shards concatenated
        and cut into one contiguous sample range per rank and worker (`split="samples"`, read
        through the index: tar offsets, Parquet row groups), so each sample comes once per
        epoch; with `even` every rank gets the same count (at most `world_size - 1` samples
        repeat). `split="auto"` reads whole shards when there are enough (see
        `ShardedIterableDataset`). `PrefetchCache` downloads with `cache`. Yields sample dicts
        (`decode`: ints, text and JSON decoded by field; images and audio stay bytes), or
        `transform(sample)`.

        With `shuffle`, each consumer's samples come in a random order within windows of
        `shuffle_window` shards (0: each shard front to back): tar samples one by one (through
        their offsets) from local or cached shards, in blocks of about `STREAM_BLOCK_BYTES`
        from streamed ones; Parquet by row group. The order is a function of `(seed, epoch)`
        and the ranks, so a resume is exact and reads nothing it skips."""
        return ShardedIterableDataset(
            self.urls,
            _ShardReader(self, cache, decode, columns, transform),
            shard_lengths=self.lengths,
            shuffle=shuffle,
            seed=seed,
            even=even,
            rank=rank,
            world_size=world_size,
            cache=cache,
            split=split,
            shard_sha256=[e.get("sha256") for e in self.entries],
            shuffle_window=shuffle_window,
            blocks=self._blocks(cache),
        )

    def _blocks(self, cache) -> _Blocks | None:
        streamed = cache is None and "://" in self.url and not self.url.startswith("file://")
        if self.format == "tar" and not streamed:
            return None  # single samples: a read of one sample's bytes at its offset
        return _Blocks(self, streamed)


class _Blocks:
    """Where a shard's samples may be cut for mixing: Parquet row groups; for tars streamed from
    a URL, runs of about `STREAM_BLOCK_BYTES` (one ranged request each) from the offsets."""

    def __init__(self, shards: ShardSet, streamed: bool):
        self.shards = shards
        self.streamed = streamed
        # for the loader state's settings
        self.name = f"{shards.format}-local"
        if streamed:
            self.name = f"{shards.format}-streamed"

    def __call__(self, shard: int) -> np.ndarray:
        entry = self.shards.entries[shard]
        if self.shards.format == "parquet":
            return np.concatenate(([0], np.cumsum(entry["row_groups"])[:-1])).astype(np.int64)
        offsets = entry.get("offsets")
        if offsets is None:  # no offsets to cut at: the whole shard
            return np.zeros(1, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        marks = offsets // STREAM_BLOCK_BYTES
        return np.flatnonzero(np.concatenate(([True], marks[1:] != marks[:-1]))).astype(np.int64)


class _ShardReader:
    """`read_shard(path, start, stop)` of a ShardSet's dataset: finds the shard by its URL or
    its cached copy's path, reads the range through the index."""

    def __init__(self, shards: ShardSet, cache, decode: bool, columns, transform):
        self.shards = shards
        self.decode = decode
        self.columns = columns
        self.transform = transform
        self.by_path = {url: i for i, url in enumerate(shards.urls)}
        if cache is not None:
            self.by_path.update({str(cache.path_for(url)): i for i, url in enumerate(shards.urls)})

    def __call__(self, path, start, stop):
        shard = self.by_path[str(path)]
        local = str(path)
        if local == self.shards.urls[shard]:  # the shard's URL, not a copy
            local = None
        # a cached copy: the dataset read it through `cache.pinned(url, sha256=)`, which checked it
        items = self.shards.read(
            shard,
            start,
            stop,
            path=local,
            decode=self.decode,
            columns=self.columns,
            verified=local is not None,
        )
        if self.transform is None:
            return items
        return map(self.transform, items)
