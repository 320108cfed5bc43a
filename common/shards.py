"""Write and read sample shards in open formats (WebDataset tar, Parquet), local or on object storage.

Use when: a dataset should live in a few large files on S3/GCS/HTTP or a shared disk and be
read exactly once per epoch over ranks and workers: `write_shards(samples, url)` writes the
shards and an index, `ShardSet.open(url).dataset(cache=PrefetchCache(...))` reads them back
as a `ShardedIterableDataset`. `index_shards(urls)` indexes shards other tools wrote
(`webdataset.ShardWriter`, Parquet exports), so the same reader takes them.
Cost: writing encodes each sample once (twice with `distributed=True`: its size, then its
bytes) and uploads each shard whole; reading fetches the index once, then each consumer's
shards (or sample ranges: tar member offsets, Parquet row groups).
Adapt here: `DEFAULT_SHARD_BYTES`, `SHARD_NAME`, `INDEX_NAME`.
Trade-off: a shard is published whole (a local rename, or one object upload completed at its
end), and the index last: a killed writer leaves no shard a reader could take and no index;
a rerun rewrites everything. Output does not depend on the number of ranks that wrote it.

Why 64 MiB shards by default: LitData (`chunk_bytes="64MB"`) and MosaicML Streaming
(`size_limit` 64 MiB) chose it; one GET of 64 MiB runs at an object store's full per-connection
bandwidth, `PrefetchCache` holds a few per worker within a small disk budget, and a 100 GB set
still has ~1,600 shards for exact splits over ranks x workers.

The index (`index.json`, JSON) per shard: its name, sample count, byte size, sha256 and, for tar,
each sample's first header offset; for Parquet, rows per row group.
Copy with: common/object_download.py, common/packed_strings.py, common/shard_formats.py,
  common/sharded_dataset.py, common/sharding.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from recipes.common.object_download import file_sha256
from recipes.common.shard_formats import (
    ShardFormatError,
    decode_sample,
    parquet_rows,
    parquet_schema,
    parquet_shard,
    parquet_value,
    read_parquet,
    read_tar,
    sample_fields,
    sample_key,
    scan_tar,
    tar_end,
    tar_sample,
)
from recipes.common.sharded_dataset import ShardedIterableDataset
from recipes.common.sharding import distributed_world

FORMAT, VERSION = "recipes-shards", 1
DEFAULT_SHARD_BYTES = 64 * 2**20
SHARD_NAME = "shard-{:06d}.{}"
INDEX_NAME = "index.json"
FORMATS = ("tar", "parquet")


class ShardIndexError(ValueError):
    """An index that is missing, damaged, of another version, or disagrees with its shards."""


def write_shards(samples: Iterable[dict], url: str | os.PathLike, *, format: str = "tar",
                 shard_bytes: int = DEFAULT_SHARD_BYTES, storage_options: dict | None = None,
                 distributed: bool = False, progress: bool = True) -> ShardSet:
    """Writes `samples` as shards of about `shard_bytes` under `url` (a folder or an fsspec URL
    such as `s3://bucket/set`), then the index; returns the `ShardSet`.

    Args:
        samples: dicts in WebDataset's convention (`"__key__"` plus fields keyed by extension:
            `"jpg"`: bytes, `"cls"`: int, `"txt"`: str, `"json"`: dict). For Parquet each field
            is a column, its type set by the first sample. With `distributed`, a sequence
            (`len` and indexing) that every rank holds the same.
        format: "tar" (WebDataset) or "parquet".
        shard_bytes: a shard is closed before the sample that would take it past this size
            (a single larger sample makes a shard of its own).
        distributed: split the work over the ranks of the initialised process group: each
            writes every world_size-th shard, rank 0 the index. The shards are the same bytes
            whatever the world size.
        progress: a progress bar (rank 0).

    Raises:
        ShardFormatError: a sample without a key, a bad key or value (naming the sample key),
            or a key twice in one shard.
        ValueError: bad arguments.
    """
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, but is {format!r} instead.")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"`shard_bytes` must be a positive int, but is {shard_bytes!r} instead.")
    writer = _Writer(os.fspath(url), format, shard_bytes, storage_options)
    world, rank = distributed_world() if distributed else (1, 0)
    if rank == 0:  # a rewrite: no reader may take the old index while its shards are replaced
        writer.remove_index()
    if distributed:
        if not isinstance(samples, Sequence) and not (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")):
            raise TypeError("write_shards(distributed=True) needs a sequence of samples (len and indexing), the same "
                            "on every rank, so that each rank can write its shards; got a "
                            f"{type(samples).__name__}.")
        entries = writer.write_distributed(samples, world, rank, progress)
    else:
        entries = writer.write_stream(samples, progress)
    if rank == 0:
        writer.publish_index(entries)
        writer.remove_stale({e["name"] for e in entries})  # shards of an earlier, larger write
    if distributed and world > 1:
        import torch.distributed as dist

        dist.barrier()
    return ShardSet.open(url, storage_options=storage_options)


class _Writer:
    def __init__(self, url: str, format: str, shard_bytes: int, storage_options: dict | None):
        import fsspec

        self.url, self.format, self.shard_bytes = url.rstrip("/"), format, shard_bytes
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.local = "file" in _protocols(self.fs)
        self.schema = None
        self.fs.makedirs(self.root, exist_ok=True)
        if self.local:
            for name in os.listdir(self.root):  # temp files of a killed writer
                if ".tmp-" in name:
                    _remove_if_dead(os.path.join(self.root, name))

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
            raise ShardFormatError(f"sample {key!r} has fields {sorted(set(sample) - {'__key__'})}, but the first "
                                   f"sample set the columns {sorted(names - {'__key__'})}; every Parquet row has the "
                                   "same columns.")
        row = {"__key__": key}
        size = len(key)
        for field in self.schema.names[1:]:
            row[field] = value = parquet_value(sample[field], key, field)
            expected = str(self.schema.field(field).type)
            kind = {bytes: "binary", str: "string", int: "int64", float: "double"}[type(value)]
            if kind != expected:
                raise ShardFormatError(f"sample {key!r}, field {field!r}: a {type(sample[field]).__name__} where the "
                                       f"first sample set the column's type to {expected}; every row's field must "
                                       "have the column's type (convert it before writing).")
            if kind == "int64" and not -2**63 <= value < 2**63:
                raise ShardFormatError(f"sample {key!r}, field {field!r}: {value} does not fit a 64-bit integer.")
            size += len(value) if isinstance(value, (bytes, str)) else 8
        return row, size, key

    # ---- shards ------------------------------------------------------------------------
    def write_stream(self, samples: Iterable[dict], progress: bool) -> list[dict]:
        from tqdm import tqdm

        entries, pending, size = [], [], 0
        total = len(samples) if hasattr(samples, "__len__") else None
        with tqdm(total=total, disable=not progress, desc="writing shards", unit="sample") as bar:
            for position, sample in enumerate(samples):
                encoded, nbytes, key = self.encode(sample, position)
                if pending and size + nbytes > self.shard_bytes:
                    entries.append(self.write_shard(len(entries), pending))
                    pending, size = [], 0
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
        with tqdm(total=n, disable=not progress or rank != 0, desc="writing shards", unit="sample") as bar:
            for s in range(rank, len(bounds) - 1, world):
                lo, hi = int(bounds[s]), int(bounds[s + 1])
                pending = [(key, encoded) for encoded, _, key in (self.encode(samples[i], i) for i in range(lo, hi))]
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
            raise ShardFormatError(f"key {twice!r} appears twice in shard {number}; keys must be unique (readers "
                                   "group a sample's files by key).")
        name = SHARD_NAME.format(number, self.format)
        entry: dict[str, Any] = {"name": name, "samples": len(pending)}
        if self.format == "tar":
            offsets = np.cumsum([0] + [len(blob) for _, blob in pending[:-1]]).tolist() if pending else []
            members = b"".join(blob for _, blob in pending)
            data = members + tar_end(len(members))
            entry["offsets"] = [int(o) for o in offsets]
        else:
            data = parquet_shard([row for _, row in pending], self.schema)
            entry["row_groups"] = _row_groups(data)
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        self.publish(name, data)
        return entry

    def publish(self, name: str, data: bytes) -> None:
        """`name` appears whole or not at all: a local rename, or one upload (a single PUT, or
        a multipart upload that only its completion makes visible)."""
        final = f"{self.root}/{name}"
        if self.local:
            temp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, final)
            return
        with tempfile.NamedTemporaryFile(prefix="recipes-shard-", suffix=name) as temp:
            temp.write(data)
            temp.flush()
            self.fs.put_file(temp.name, final)

    def remove_index(self) -> None:
        try:
            self.fs.rm_file(f"{self.root}/{INDEX_NAME}")
        except FileNotFoundError:
            pass

    def remove_stale(self, keep: set[str]) -> None:
        """Shards named as ours but not in the index just written (an earlier write had more)."""
        pattern = re.compile(r"shard-\d{6}\.(tar|parquet)$")
        for path in self.fs.ls(self.root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if pattern.match(name) and name not in keep:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass

    def publish_index(self, entries: list[dict]) -> None:
        index = {"format": FORMAT, "version": VERSION, "shard_format": self.format,
                 "samples": int(sum(e["samples"] for e in entries)), "shards": entries}
        if self.schema is not None:
            index["columns"] = [[f.name, str(f.type)] for f in self.schema]
        self.publish(INDEX_NAME, json.dumps(index, separators=(",", ":")).encode())


def _boundaries(sizes: np.ndarray, limit: int) -> list[int]:
    """Shard starts (and the end): a shard closes before the sample that would pass `limit`."""
    bounds, size = [0], 0
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


def _row_groups(data: bytes) -> list[int]:
    import io

    import pyarrow.parquet as pq

    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _protocols(fs) -> tuple:
    protocol = fs.protocol
    return protocol if isinstance(protocol, tuple) else (protocol,)


def _remove_if_dead(path: str) -> None:
    try:
        pid = int(path.rsplit(".tmp-", 1)[1].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, IndexError):
        return
    except ProcessLookupError:
        try:
            os.remove(path)
        except OSError:
            pass
    except PermissionError:
        return


class ShardSet:
    """The shards under a URL and their index (`write_shards` or `index_shards` wrote it).

    Attributes:
        url: the folder or URL; `urls`: each shard's URL; `lengths`: samples per shard;
        `format`: "tar" or "parquet"; `entries`: the index's per-shard records.
    """

    def __init__(self, url: str, index: dict, storage_options: dict | None = None):
        self.url, self.storage_options = url.rstrip("/"), storage_options
        self.format = index["shard_format"]
        self.entries = index["shards"]
        self.urls = [f"{self.url}/{e['name']}" for e in self.entries]
        self.lengths = np.array([e["samples"] for e in self.entries], dtype=np.int64)
        self.columns = index.get("columns")

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
            raise ShardIndexError(f"{path} does not exist: write the shards with write_shards(), or index shards "
                                  "written by another tool with index_shards() (`recipes shards index`).") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ShardIndexError(f"{path} is damaged ({error}); rebuild it with index_shards().") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ShardIndexError(f"{path} is not a {FORMAT} v{VERSION} index; rebuild it with index_shards().")
        shards = index.get("shards")
        if index.get("shard_format") not in FORMATS or not isinstance(shards, list) or not all(
                isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("samples"), int)
                and e["samples"] >= 0 for e in shards):
            raise ShardIndexError(f"{path} is incomplete or damaged (no shard_format, or a shard entry without its "
                                  "name and sample count); rebuild it with index_shards() or rewrite the shards.")
        return cls(url, index, storage_options)

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def __repr__(self) -> str:
        return f"ShardSet({self.url!r}, {self.format}, {len(self.entries)} shards, {len(self)} samples)"

    def read(self, shard: int, start: int = 0, stop: int | None = None, *, path: str | None = None,
             decode: bool = True, columns: Sequence[str] | None = None, verified: bool = False):
        """The samples `[start, stop)` of shard `shard`, from `path` (a local copy) or its URL.
        A local file is checked against the index first (size, and sha256 once per process and
        file version, unless `verified`: a copy `PrefetchCache.get(url, sha256=)` checked);
        any read must yield the samples the index promises.

        Raises:
            ShardFormatError: a shard that differs from its index (damaged, or rewritten since
                the index was read), or yields fewer samples than it says.
        """
        entry = self.entries[shard]
        source = path if path is not None else self.urls[shard]
        options = None if path is not None else self.storage_options
        local = "://" not in str(source) or str(source).startswith("file://")
        if local:
            _check_local(str(source).removeprefix("file://"), entry, self.urls[shard], hash=not verified)
        if self.format == "tar":
            items = read_tar(source, start, stop, offsets=entry.get("offsets"), storage_options=options)
            items = (decode_sample(s) for s in items) if decode else items
        else:
            items = read_parquet(source, start, stop, columns=columns, storage_options=options)
            items = (_decoded_row(r, self.columns) for r in items) if decode else items
        want = max(0, min(int(entry["samples"]), int(entry["samples"]) if stop is None else stop) - start)
        return _counted(items, want, self.urls[shard])

    def dataset(self, *, cache=None, shuffle: bool = True, seed: int = 0, even: bool = True,
                split: str = "samples", decode: bool = True, columns: Sequence[str] | None = None,
                transform=None, rank: int | None = None, world_size: int | None = None) -> ShardedIterableDataset:
        """A `ShardedIterableDataset` over the shards: the epoch's shuffled shards concatenated
        and cut into one contiguous sample range per rank and worker (`split="samples"`, read
        through the index: tar offsets, Parquet row groups), so each sample comes once per
        epoch; with `even` every rank gets the same count (at most `world_size - 1` samples
        repeat). `split="auto"` reads whole shards when there are enough (see
        `ShardedIterableDataset`). `PrefetchCache` downloads with `cache`. Yields sample dicts
        (`decode`: ints, text and JSON decoded by field; images and audio stay bytes), or
        `transform(sample)`."""
        return ShardedIterableDataset(self.urls, _ShardReader(self, cache, decode, columns, transform),
                                      shard_lengths=self.lengths, shuffle=shuffle, seed=seed, even=even,
                                      rank=rank, world_size=world_size, cache=cache, split=split,
                                      shard_sha256=[e.get("sha256") for e in self.entries])


class _ShardReader:
    """`read_shard(path, start, stop)` of a ShardSet's dataset: finds the shard by its URL or
    its cached copy's path, reads the range through the index."""

    def __init__(self, shards: ShardSet, cache, decode: bool, columns, transform):
        self.shards, self.decode, self.columns, self.transform = shards, decode, columns, transform
        self.by_path = {url: i for i, url in enumerate(shards.urls)}
        if cache is not None:
            self.by_path.update({str(cache.path_for(url)): i for i, url in enumerate(shards.urls)})

    def __call__(self, path, start, stop):
        shard = self.by_path[str(path)]
        local = None if str(path) == self.shards.urls[shard] else str(path)
        # a cached copy: the dataset read it through `cache.pinned(url, sha256=)`, which checked it
        items = self.shards.read(shard, start, stop, path=local, decode=self.decode, columns=self.columns,
                                 verified=local is not None)
        return items if self.transform is None else map(self.transform, items)


def _check_local(path: str, entry: dict, url: str, *, hash: bool = True) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ShardFormatError(f"{url} is missing (its index lists it); rewrite the shards or re-index them.") from None
    if "bytes" in entry and info.st_size != entry["bytes"]:
        raise ShardFormatError(f"{url} is {info.st_size:,} bytes but its index says {entry['bytes']:,}: damaged, or "
                               "rewritten since the index was read. Rewrite the shards (or re-index them).")
    if hash and entry.get("sha256"):
        if file_sha256(path, info) != entry["sha256"]:
            raise ShardFormatError(f"{url} does not match its index (sha256): damaged, or rewritten by another "
                                   "writer since the index was read. Rewrite the shards (or re-index them).")


def _counted(items, want: int, url: str):
    """`items`, raising if they end before `want` samples (a shard cut short)."""
    got = 0
    for item in items:
        got += 1
        yield item
    if got < want:
        raise ShardFormatError(f"{url} gave {got} samples where its index says {want}: cut short or damaged. "
                               "Rewrite the shards (or re-index them).")


def _decoded_row(row: dict, columns) -> dict:
    """JSON columns (written from dicts/lists) are text in Parquet: decoded by field name."""
    return {k: (json.loads(v) if k == "json" and isinstance(v, str) else v) for k, v in row.items()}


def index_shards(urls: Sequence[str], *, url: str | None = None, storage_options: dict | None = None,
                 progress: bool = True) -> ShardSet:
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
    formats = {"parquet" if u.endswith(".parquet") else "tar" if u.endswith(".tar") else None for u in urls}
    if None in formats or len(formats) != 1:
        raise ValueError(f"index_shards() takes .tar or .parquet shards of one format; got {sorted(map(str, formats))}.")
    folders = {u.rsplit("/", 1)[0] for u in urls}
    folder = (url or (folders.pop() if len(folders) == 1 else None))
    if folder is None:
        raise ValueError(f"the shards are in {len(folders)} folders, but an index names its shards relative to "
                         "its own folder: move (or copy) them into one folder and index them there.")
    folder = folder.rstrip("/")
    if any(u.rsplit("/", 1)[0] != folder for u in urls):
        raise ValueError(f"every shard must be in {folder}, the index's folder (it names shards relative to it).")
    shard_format = formats.pop()
    entries = []
    for u in tqdm(urls, disable=not progress, desc="indexing shards", unit="shard"):
        with fsspec.open(u, "rb", **(storage_options or {})) as f:
            digest, size = hashlib.sha256(), 0
            while chunk := f.read(1 << 22):
                digest.update(chunk)
                size += len(chunk)
        entry: dict[str, Any] = {"name": u.rsplit("/", 1)[1]}
        if shard_format == "tar":
            entry["samples"], entry["offsets"] = scan_tar(u, storage_options)
        else:
            entry["row_groups"] = parquet_rows(u, storage_options)
            entry["samples"] = int(sum(entry["row_groups"]))
        entry["bytes"], entry["sha256"] = size, digest.hexdigest()
        entries.append(entry)
    writer = _Writer(folder, shard_format, DEFAULT_SHARD_BYTES, storage_options)
    writer.publish_index(entries)
    return ShardSet.open(folder, storage_options=storage_options)
