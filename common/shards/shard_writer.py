"""`write_shards`: samples to shards in open formats (WebDataset tar, Parquet) and their index,
local or on object storage, from one process or split over ranks.

Use when: a dataset should live in a few large files on S3/GCS/HTTP or a shared disk
(`write_shards(samples, url)`); `shard_set.py` reads them back.
Cost: encodes each sample once (twice with `distributed=True`: its size, then its bytes) and
uploads each shard whole.
Adapt here: `DEFAULT_SHARD_BYTES`, `SHARD_NAME`, `shard_index.INDEX_NAME`; the shuffle's buffer:
`shard_mixing.SHUFFLE_BUFFER_BYTES`.
Trade-off: a shard is published whole (a local rename, or one object upload completed at its
end), and the index last: a killed writer leaves no shard a reader could take and no index;
a rerun rewrites everything. Output does not depend on the number of ranks that wrote it.

Why the input is shuffled by default (`shuffle=True`): data comes in an order (an ImageFolder
listed by class, a corpus by source or date), and shards written in that order hold one class
each; readers mix the samples of a window of shards (`ShardedIterableDataset`), which cannot mix
what a single shard, or every shard of a window, lacks. A sequence is written in a permutation
seeded by `seed` (it is indexed in that order: a folder's files are read in random order); a
stream goes through a buffer of `SHUFFLE_BUFFER_BYTES` of samples (memory: that much, and the
mixing reaches about that far: input sorted into runs longer than the buffer stays partly sorted
across shards). Keys are kept, so the order never changes what a sample is.

Why 64 MiB shards by default: LitData (`chunk_bytes="64MB"`) and MosaicML Streaming
(`size_limit` 64 MiB) chose it; one GET of 64 MiB runs at an object store's full per-connection
bandwidth, `PrefetchCache` holds a few per worker within a small disk budget, and a 100 GB set
still has ~1,600 shards for exact splits over ranks x workers.
Copy with: common/caches/cache_folder.py, common/caches/packed_strings.py,
  common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_formats.py, common/shards/shard_index.py, common/shards/shard_output.py,
  common/shards/shard_samples.py, common/shards/shard_set.py, common/shards/sharded_dataset.py,
  common/shards/tar_members.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from recipes.common.sampling.sharding import distributed_world
from recipes.common.shards.epochs.shard_mixing import shuffled_samples
from recipes.common.shards.shard_checks import file_digests, parquet_digests
from recipes.common.shards.shard_formats import (
    parquet_schema,
    parquet_shard,
    parquet_value,
    scan_tar,
)
from recipes.common.shards.shard_index import INDEX_NAME, SUMS, new_index
from recipes.common.shards.shard_output import ShardOutput
from recipes.common.shards.shard_samples import (
    ShardFormatError,
    sample_fields,
    sample_key,
)
from recipes.common.shards.shard_set import ShardSet
from recipes.common.shards.tar_members import tar_end, tar_sample

DEFAULT_SHARD_BYTES = 64 * 2**20
SHARD_NAME = "shard-{:06d}.{}"
FORMATS = ("tar", "parquet")


def write_shards(
    samples: Iterable[dict],
    url: str | os.PathLike,
    *,
    format: str = "tar",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    storage_options: dict | None = None,
    distributed: bool = False,
    progress: bool = True,
    shuffle: bool = True,
    seed: int = 0,
) -> ShardSet:
    """Writes `samples` as shards of about `shard_bytes` under `url` (a folder or an fsspec URL
    such as `s3://bucket/set`), then the index; returns the `ShardSet`.

    Args:
        samples: dicts in WebDataset's convention (`"__key__"` plus fields keyed by extension:
            `"jpg"`: bytes, `"cls"`: int, `"txt"`: str, `"json"`: dict; a value other than bytes
            only under a field that reads back as its type: `recipes.common.shards.shard_samples`).
            For Parquet each field is a column, its type set by the first sample. With
            `distributed`, a sequence (`len` and indexing) that every rank holds the same.
        format: "tar" (WebDataset) or "parquet".
        shard_bytes: a shard is closed before the sample that would take it past this size
            (a single larger sample makes a shard of its own).
        distributed: split the work over the ranks of the initialised process group: each
            writes every world_size-th shard, rank 0 the index. The shards are the same bytes
            whatever the world size.
        progress: a progress bar (rank 0).
        shuffle: write the samples in a random order (module docstring): a sequence in a
            permutation, a stream through a buffer of `SHUFFLE_BUFFER_BYTES`; False keeps the
            input's order (shards whose order means something: time, a curriculum).
        seed: the shuffle's seed (every rank's the same with `distributed`).

    Raises:
        ShardFormatError: a sample without a key, a bad key or value (naming the sample key),
            a value readers would not give back (an int over 64 bits, an int under "jpg", a
            field `__x__`), or a key twice in one shard.
        ValueError: bad arguments.
    """
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, but is {format!r} instead.")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"`shard_bytes` must be a positive int, but is {shard_bytes!r} instead.")
    if shuffle:
        samples = shuffled_samples(samples, seed=seed)
    writer = _Writer(os.fspath(url), format, shard_bytes, storage_options)
    world = 1
    rank = 0
    if distributed:
        world, rank = distributed_world()
    if rank == 0:  # a rewrite: no reader may take the old index while its shards are replaced
        writer.output.remove_index()
    if distributed:
        if not isinstance(samples, Sequence) and not (
            hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
        ):
            raise TypeError(
                "write_shards(distributed=True) needs a sequence of samples (len and indexing), "
                "the same on every rank, so that each rank can write its shards; got a "
                f"{type(samples).__name__}."
            )
        entries = writer.write_distributed(samples, world, rank, progress)
    else:
        entries = writer.write_stream(samples, progress)
    if rank == 0:
        writer.publish_index(entries)
        writer.output.remove_stale(
            {e["name"] for e in entries}
        )  # shards of an earlier, larger write
    if distributed and world > 1:
        import torch.distributed as dist

        dist.barrier()
    return ShardSet.open(url, storage_options=storage_options)


class _Writer:
    """Samples encoded and cut into shards, published to `output` with their index."""

    def __init__(self, url: str, format: str, shard_bytes: int, storage_options: dict | None):
        self.output = ShardOutput(url, storage_options)
        self.format = format
        self.shard_bytes = shard_bytes
        self.schema = None

    # ---- one sample --------------------------------------------------------------------
    def encode(self, sample: Any, position: int) -> tuple[Any, int, str]:
        """`(what the shard stores for it, its size, its key)`."""
        key = sample_key(sample, position)
        if self.format == "tar":
            blob = tar_sample(key, sample_fields(sample, key))
            return blob, len(blob), key
        if self.schema is None:
            self.schema = parquet_schema(sample, key)
        names = set(self.schema.names)
        if set(sample) != names:
            raise ShardFormatError(
                f"sample {key!r} has fields {sorted(set(sample) - {'__key__'})}, but the first "
                f"sample set the columns {sorted(names - {'__key__'})}; every Parquet row has the "
                "same columns."
            )
        row = {"__key__": key}
        size = len(key)
        for field in self.schema.names[1:]:
            row[field] = value = parquet_value(sample[field], key, field)
            expected = str(self.schema.field(field).type)
            kind = {bytes: "binary", str: "string", int: "int64", float: "double"}[type(value)]
            if kind != expected:
                raise ShardFormatError(
                    f"sample {key!r}, field {field!r}: a {type(sample[field]).__name__} where the "
                    f"first sample set the column's type to {expected}; every row's field must "
                    "have the column's type (convert it before writing)."
                )
            size += _stored_size(value)
        return row, size, key

    # ---- shards ------------------------------------------------------------------------
    def write_stream(self, samples: Iterable[dict], progress: bool) -> list[dict]:
        from tqdm import tqdm

        entries = []
        pending = []
        size = 0
        total = None
        if hasattr(samples, "__len__"):
            total = len(samples)
        with tqdm(total=total, disable=not progress, desc="writing shards", unit="sample") as bar:
            for position, sample in enumerate(samples):
                encoded, nbytes, key = self.encode(sample, position)
                if pending and size + nbytes > self.shard_bytes:
                    entries.append(self.write_shard(len(entries), pending))
                    pending = []
                    size = 0
                pending.append((key, encoded))
                size += nbytes
                bar.update(1)
        if pending or not entries:
            entries.append(self.write_shard(len(entries), pending))
        return entries

    def write_distributed(self, samples, world: int, rank: int, progress: bool) -> list[dict]:
        """Sizes by all ranks (every world_size-th sample each), the same shard boundaries on
        every rank, then every world_size-th shard written here; entries gathered in order."""
        from tqdm import tqdm

        n = len(samples)
        if n and self.format == "parquet":
            self.schema = parquet_schema(samples[0], sample_key(samples[0], 0))
        mine = {i: self.encode(samples[i], i)[1] for i in range(rank, n, world)}
        sizes = np.zeros(n, np.int64)
        for part in _all_gather(mine, world):
            for i, nbytes in part.items():
                sizes[int(i)] = nbytes
        bounds = _boundaries(sizes, self.shard_bytes)
        written = {}
        with tqdm(
            total=n, disable=not progress or rank != 0, desc="writing shards", unit="sample"
        ) as bar:
            for s in range(rank, len(bounds) - 1, world):
                lo = int(bounds[s])
                hi = int(bounds[s + 1])
                pending = [
                    (key, encoded)
                    for encoded, _, key in (self.encode(samples[i], i) for i in range(lo, hi))
                ]
                written[s] = self.write_shard(s, pending)
                bar.update((hi - lo) * world)
        entries = {}
        for part in _all_gather(written, world):
            entries.update({int(s): e for s, e in part.items()})
        return [entries[s] for s in range(len(bounds) - 1)]

    def write_shard(self, number: int, pending: list[tuple[str, Any]]) -> dict:
        keys = [key for key, _ in pending]
        if len(set(keys)) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise ShardFormatError(
                f"key {twice!r} appears twice in shard {number}; keys must be unique (readers "
                "group a sample's files by key)."
            )
        name = SHARD_NAME.format(number, self.format)
        entry: dict[str, Any] = {"name": name, "samples": len(pending)}
        if self.format == "tar":
            offsets = []
            position = 0
            for _, blob in pending:
                offsets.append(position)
                position += len(blob)
            members = b"".join(blob for _, blob in pending)
            data = members + tar_end(len(members))
            entry["offsets"] = offsets
            entry["end"] = len(members)
            entry[SUMS] = [xxhash.xxh3_64_intdigest(blob) for _, blob in pending]
        else:
            if self.schema is None:  # an empty write
                self.schema = parquet_schema({}, "")
            data = parquet_shard([row for _, row in pending], self.schema)
            entry["row_groups"], entry[SUMS], _ = parquet_digests(data)
        entry["bytes"] = len(data)
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        self.output.publish(name, data)
        return entry

    def publish_index(self, entries: list[dict]) -> None:
        columns = None
        if self.schema is not None:
            columns = [[f.name, str(f.type)] for f in self.schema]
        index = new_index(self.format, entries, columns, self.output.url)
        self.output.publish(INDEX_NAME, json.dumps(index, separators=(",", ":")).encode())


def _stored_size(value) -> int:
    """About the bytes a Parquet value takes (a number: 8)."""
    if isinstance(value, (bytes, str)):
        return len(value)
    return 8


def _boundaries(sizes: np.ndarray, limit: int) -> list[int]:
    """Shard starts (and the end): a shard closes before the sample that would pass `limit`."""
    bounds = [0]
    size = 0
    for i, nbytes in enumerate(sizes.tolist()):
        if i > bounds[-1] and size + nbytes > limit:
            bounds.append(i)
            size = 0
        size += nbytes
    bounds.append(len(sizes))
    return bounds


def _all_gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def index_shards(
    urls: Sequence[str],
    *,
    url: str | None = None,
    storage_options: dict | None = None,
    progress: bool = True,
) -> ShardSet:
    """Indexes existing shards (tars in WebDataset's layout, or Parquet files) by one scan each
    and writes `index.json` into their folder (or `url`); returns the `ShardSet`.

    Raises:
        ValueError: no shards, mixed formats, or shards in several folders without `url`.
        ShardFormatError: a shard that does not read as its format.
    """
    import fsspec
    from tqdm import tqdm

    urls = [os.fspath(u) for u in urls]
    if not urls:
        raise ValueError("index_shards() needs at least one shard URL.")
    formats = {_format_of(u) for u in urls}
    if None in formats or len(formats) != 1:
        raise ValueError(
            "index_shards() takes .tar or .parquet shards of one format; got "
            f"{sorted(map(str, formats))}."
        )
    folders = {u.rsplit("/", 1)[0] for u in urls}
    folder = url
    if not url:
        folder = None
        if len(folders) == 1:
            folder = folders.pop()
    if folder is None:
        raise ValueError(
            f"the shards are in {len(folders)} folders, but an index names its shards relative to "
            "its own folder: move (or copy) them into one folder and index them there."
        )
    folder = folder.rstrip("/")
    if any(u.rsplit("/", 1)[0] != folder for u in urls):
        raise ValueError(
            f"every shard must be in {folder}, the index's folder (it names shards relative to it)."
        )
    shard_format = formats.pop()
    entries = []
    for u in tqdm(urls, disable=not progress, desc="indexing shards", unit="shard"):
        entry: dict[str, Any] = {"name": u.rsplit("/", 1)[1]}
        if shard_format == "tar":  # the headers, then every byte once: sha256, each sample's xxh3
            entry["samples"], entry["offsets"], entry["end"] = scan_tar(u, storage_options)
            with fsspec.open(u, "rb", **(storage_options or {})) as f:
                entry["bytes"], entry["sha256"], entry[SUMS] = file_digests(
                    f, [*entry["offsets"], entry["end"]]
                )
        else:
            with fsspec.open(u, "rb", **(storage_options or {})) as f:
                entry["bytes"], entry["sha256"], _ = file_digests(f, [])
                f.seek(0)
                entry["row_groups"], entry[SUMS], entry["columns"] = parquet_digests(f, u)
            entry["samples"] = int(sum(entry["row_groups"]))
        entries.append(entry)
    writer = _Writer(folder, shard_format, DEFAULT_SHARD_BYTES, storage_options)
    writer.publish_index(entries)
    return ShardSet.open(folder, storage_options=storage_options)


def _format_of(url: str) -> str | None:
    """A shard's format by its suffix (None: neither)."""
    if url.endswith(".parquet"):
        return "parquet"
    if url.endswith(".tar"):
        return "tar"
    return None
