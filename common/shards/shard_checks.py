"""What a shard index promises about the shards, checked: each shard's size and sha256 where the
whole file is at hand, each sample's bytes (an xxh3-64 per tar sample, per Parquet row group and
column) before the sample is served, and the digests `write_shards` records.

Use when: reading shards through `ShardSet` (`recipes.common.shards.shard_set`), on every path: a
local file, `PrefetchCache`'s copy, a remote object streamed or read by sample ranges. The sha256 of
a whole shard is checked only where the whole file is at hand (local, cached); the per-sample
checksums cover the rest, so that a damaged sample raises `ShardFormatError` naming its shard
instead of being served with other bytes.
Cost: xxhash's xxh3-64 over the bytes read, about 60 GB/s on one core (`zlib.crc32` ran at
3-4 GB/s, 16 us per 100 KB JPEG, up to 8% of a one-worker epoch from local disk; sha256 at
1.8 GB/s): about 2 us per 100 KB JPEG. The index holds one more integer per tar sample (the
`offsets` list is already per sample) and one per Parquet row group and column.
Adapt here: `column_crc` (how a Parquet column is hashed: value bytes, lengths and nulls; other
types through their Python values).
Trade-off: a 64-bit checksum detects damage (all but 1 in 2^64 of random changes), not
tampering; that is the shard's sha256's job where the file is whole. A v1 index reads
unverified (`shard_index.py`). Every offset a tar read uses must start a key's first header
(`ShardIndexError`, a `ShardFormatError` too).
Copy with: common/caches/cache_folder.py, common/remote/object_download.py,
  common/shards/shard_index.py, common/shards/shard_samples.py, common/shards/tar_members.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence

import numpy as np
import xxhash

from recipes.common.remote.object_download import file_sha256
from recipes.common.shards.shard_index import ShardIndexError
from recipes.common.shards.shard_samples import ShardFormatError
from recipes.common.shards.tar_members import tar_header_at, tar_key_starts


# ---- a shard as a whole ----------------------------------------------------------------------
def check_local_shard(path: str, entry: dict, url: str, *, hash: bool = True) -> None:
    """A local shard (or a cached copy) has the index's size and (with `hash`) sha256."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ShardFormatError(
            f"{url} is missing (its index lists it); rewrite the shards or re-index them."
        ) from None
    if "bytes" in entry and info.st_size != entry["bytes"]:
        raise ShardFormatError(
            f"{url} is {info.st_size:,} bytes but its index says {entry['bytes']:,}: damaged, or "
            "rewritten since the index was read. Rewrite the shards (or re-index them)."
        )
    if hash and entry.get("sha256"):
        if file_sha256(path, info) != entry["sha256"]:
            raise ShardFormatError(
                f"{url} does not match its index (sha256): damaged, or rewritten by another "
                "writer since the index was read. Rewrite the shards (or re-index them)."
            )


def counted(items, want: int, url: str):
    """`items`, raising if they end before `want` samples (a shard cut short) or go past them;
    an error that names a local copy (`PrefetchCache`'s) is raised again naming `url` too."""
    got = 0
    try:
        for item in items:
            got += 1
            if got > want:
                raise ShardFormatError(
                    f"{url} gives more samples than the {want} its index says for the range: "
                    "damaged, or rewritten since the index was read. Rewrite the shards (or "
                    "re-index them)."
                )
            yield item
    except ShardFormatError as error:
        if url in str(error):
            raise
        raise ShardFormatError(f"{url}, read from a local copy: {error}") from None
    except FileNotFoundError:  # a remote one (a local one is checked first)
        raise ShardFormatError(
            f"{url} is missing (its index lists it); rewrite the shards or re-index them."
        ) from None
    if got < want:
        raise ShardFormatError(
            f"{url} gave {got} samples where its index says {want}: cut short or damaged. "
            "Rewrite the shards (or re-index them)."
        )


# ---- tar: one xxh3-64 per sample over its members' bytes -------------------------------------
def tar_range_check(
    url: str,
    offsets: Sequence[int],
    end: int | None,
    crcs: np.ndarray | None,
    start: int,
    stop: int | None,
):
    """`read_tar`'s `check(data, begin)`: in the bytes read from `begin`, each offset of `[start,
    stop)` starts the tar header of a new key (`ShardIndexError` naming the offset), then (with
    `crcs`) each sample has the checksum of the index (a sample runs to the next one's offset, the
    last to `end`)."""
    if stop is None or stop > len(offsets):
        stop = len(offsets)

    def check(data: bytes, begin: int) -> None:
        check_starts(url, [int(offsets[i]) - begin for i in range(start, stop)], data, begin, start)
        if crcs is None:
            return
        view = memoryview(data)
        for i in range(start, stop):
            lo = offsets[i] - begin
            hi = end - begin  # the last sample runs to `end`, the others to the next offset
            if i + 1 < len(offsets):
                hi = offsets[i + 1] - begin
            if hi > len(view) or xxhash.xxh3_64_intdigest(view[lo:hi]) != crcs[i]:
                raise ShardFormatError(
                    f"{url}: sample {i} (bytes {offsets[i]:,} to {hi + begin:,}) does not match "
                    "its index (checksum): damaged, or rewritten since the index was read. Rewrite "
                    "the shards (or re-index them)."
                )

    return check


def check_starts(url: str, wanted: list[int], data: bytes, begin: int, first: int) -> None:
    """The keys in `data` (read from byte `begin`) start at `wanted` (sample `first`'s onwards),
    no more, no fewer: as far as the headers parse (damage is the checksums' to name). The first
    offset must start a tar header; whether its key is new would need the bytes before it, which
    a range read does not fetch: there the checksum catches an offset on a sample's later member.

    Raises:
        ShardIndexError: an offset that does not start a tar header of a new key, or a key that
            starts where the index lists no offset, naming the shard and the byte.
    """
    starts, known = tar_key_starts(data)
    found = set(starts)
    listed = set(wanted)
    for i, at in enumerate(wanted, start=first):
        header = tar_header_at(data, at)
        if header is False or (header and at < known and at not in found):
            what = "a tar header of a new key" if header else "a tar header"
            raise ShardIndexError(
                f"{url}: its index says sample {i} starts at byte {at + begin:,}, but that byte "
                f"does not start {what}: the index is damaged, or not this shard's. Rebuild it "
                "with index_shards() or rewrite the shards."
            )
    extra = next((at for at in starts if at < known and at not in listed), None)
    if extra is not None:
        raise ShardIndexError(
            f"{url}: a new key starts at byte {extra + begin:,}, but its index lists no sample "
            "there: the index is damaged, or not this shard's. Rebuild it with index_shards() or "
            "rewrite the shards."
        )


def file_digests(f, bounds: Sequence[int]) -> tuple[int, str, list[int]]:
    """`(size, sha256, xxh3-64 of each [bounds[i], bounds[i+1]))` of the open file `f`, in one
    pass."""
    sha = hashlib.sha256()
    crcs = []
    crc = xxhash.xxh3_64()
    pos = 0
    i = 0
    while chunk := f.read(1 << 22):
        sha.update(chunk)
        view = memoryview(chunk)
        at = 0
        while i + 1 < len(bounds):
            lo = max(bounds[i] - pos, at)
            hi = bounds[i + 1] - pos
            if lo < min(hi, len(view)):
                crc.update(view[lo : min(hi, len(view))])
            if hi > len(view):
                break
            crcs.append(crc.intdigest())
            crc = xxhash.xxh3_64()
            at = hi
            i = i + 1
        pos += len(chunk)
    return pos, sha.hexdigest(), crcs


# ---- parquet: one xxh3-64 per row group and column -------------------------------------------
def column_crc(column) -> int:
    """xxh3-64 of a pyarrow column's values, the same whatever its chunks: its type, its nulls,
    and the value bytes (fixed width), or lengths and bytes (binary, string), or their Python
    values."""
    import pyarrow as pa
    import pyarrow.types as pt

    chunks = [column]
    if isinstance(column, pa.ChunkedArray):
        chunks = column.chunks
    kind = column.type
    head = xxhash.xxh3_64(str(kind).encode())
    if column.null_count:  # the null mask (none: nothing to hash)
        for chunk in chunks:
            head.update(np.asarray(chunk.is_valid().to_numpy(zero_copy_only=False), bool).tobytes())
    if pt.is_integer(kind) or pt.is_floating(kind):
        width = kind.bit_width // 8
        for chunk in chunks:  # the values buffer as it is, unless nulls need filling
            if chunk.null_count:
                head.update(chunk.fill_null(0).to_numpy(zero_copy_only=False).tobytes())
            else:
                head.update(
                    memoryview(chunk.buffers()[1])[
                        chunk.offset * width : (chunk.offset + len(chunk)) * width
                    ]
                )
        return head.intdigest()
    if not (
        pt.is_binary(kind)
        or pt.is_string(kind)
        or pt.is_large_binary(kind)
        or pt.is_large_string(kind)
    ):
        head.update(repr(column.to_pylist()).encode())
        return head.intdigest()
    wide = pt.is_large_binary(kind) or pt.is_large_string(kind)
    values = xxhash.xxh3_64()  # two running hashes: every length (`head`), then every value byte
    for chunk in chunks:
        _, offsets_buffer, data = chunk.buffers()
        offsets = np.frombuffer(offsets_buffer, np.int64 if wide else np.int32)[
            chunk.offset : chunk.offset + len(chunk) + 1
        ]
        head.update(np.diff(offsets).tobytes())
        if len(offsets) and offsets[-1] > offsets[0] and data is not None:
            values.update(memoryview(data)[int(offsets[0]) : int(offsets[-1])])
    head.update(values.intdigest().to_bytes(8, "little"))
    return head.intdigest()


def parquet_digests(
    source, url: str = "Parquet data"
) -> tuple[list[int], list[list[int]], list[list[str]]]:
    """`(rows per row group, per row group the xxh3-64 of each column, [name, type] per column)`
    of `source` (Parquet bytes or an open file).

    Raises:
        ShardFormatError: it does not read as Parquet (naming `url`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if isinstance(source, bytes):
            source = io.BytesIO(source)
        file = pq.ParquetFile(source)
        groups = [file.read_row_group(g) for g in range(file.num_row_groups)]
        crcs = [[column_crc(t.column(i)) for i in range(t.num_columns)] for t in groups]
        return (
            [t.num_rows for t in groups],
            crcs,
            [[c.name, str(c.type)] for c in file.schema_arrow],
        )
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError) as error:
        raise ShardFormatError(
            f"{url} does not read as Parquet ({type(error).__name__}: {error})."
        ) from None


def parquet_group_check(url: str, columns: list[list[str]] | None, crcs: list[list[int]] | None):
    """`read_parquet`'s `check(group, table)`: the row group's columns have the index's names,
    types and (with `crcs`) checksums."""
    position = {name: (i, kind) for i, (name, kind) in enumerate(columns or [])}
    # schemas already seen to match the index (every row group of a file has the file's)
    matching = []

    def check(group: int, table) -> None:
        if columns is not None and not any(table.schema.equals(schema) for schema in matching):
            for name, column in zip(table.column_names, table.columns, strict=True):
                if name not in position or str(column.type) != position[name][1]:
                    raise ShardFormatError(
                        f"{url}: row group {group} has a column {name!r} of type {column.type}, "
                        "which its index does not list: damaged, or not the shard the index was "
                        "made of. Rewrite the shards (or re-index them)."
                    )
            matching.append(table.schema)
        if crcs is None:
            return
        for name, column in zip(table.column_names, table.columns, strict=True):
            if column_crc(column) != crcs[group][position[name][0]]:
                raise ShardFormatError(
                    f"{url}: row group {group}, column {name!r} does not match its index "
                    "(checksum): damaged, or rewritten since the index was read. Rewrite the "
                    "shards (or re-index them)."
                )

    return check
