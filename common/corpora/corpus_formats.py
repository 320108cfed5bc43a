"""Reading a corpus object's rows: a Parquet file's footer and row groups, a JSONL file's lines
(plain, gzip or zstd, decompressed as they stream), with damage reported as `CorpusFormatError`
naming the object.

Use when: planning an object (`plan_parquet`: its footer only, by ranged reads; `plan_jsonl`:
one streamed read that counts its lines, hashes its bytes and notes where its blocks start) or
reading rows of it (`parquet_rows`, `jsonl_lines`, `document`).
Cost: Parquet: the footer, then only the row groups asked for, of the columns asked for. JSONL:
the object streamed once to plan; reads stream from the nearest block start (plain) or from where
the last read of the object stopped (compressed: no random access).
Adapt here: `BLOCK_ROWS` (JSONL rows per block: the grain of mixing and of a resumed read).
Trade-off: a compressed JSONL object read out of order is decompressed again from its start;
Parquet, or plain JSONL, avoids it.
Copy with: common/caches/cache_files.py, common/corpora/corpus_index.py,
  common/corpora/corpus_objects.py, common/remote/object_urls.py,
  common/workers/held_descriptors.py.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterator, Sequence

from recipes.common.corpora.corpus_index import ObjectPlan
from recipes.common.corpora.corpus_objects import CorpusFormatError, ObjectKind

BLOCK_ROWS = 1024


class DamagedStream(ValueError):
    """A compressed stream that does not decompress (zstd's own errors, a frame cut short)."""


DAMAGE = (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError, DamagedStream)
ZSTD_CHUNK = 1 << 16  # compressed bytes read per call


class HashingReader(io.RawIOBase):
    """A raw binary stream over `raw` that hashes (sha256) and counts the bytes read through it."""

    def __init__(self, raw):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        count = len(data)
        buffer[:count] = data
        self.sha256.update(data)
        self.position += count
        return count


def decompressed(raw, compression: str | None, url: str):
    """`raw` (a binary stream) decompressed as `compression` says, as a buffered binary stream.

    Raises:
        ImportError: zstd without the `zstandard` module.
    """
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ImportError(
                f'Reading {url} (zstd) needs zstandard: pip install "loader-recipes[stream]".'
            ) from None
        return io.BufferedReader(ZstdFrames(raw, zstandard))
    return io.BufferedReader(raw)


class ZstdFrames(io.RawIOBase):
    """The zstd frames of `raw` decompressed one after another, raising `DamagedStream` where
    the stream is not zstd or ends inside a frame (zstandard's `stream_reader` ends quietly
    there: a truncated object would read as fewer rows)."""

    def __init__(self, raw, zstandard):
        self.raw = raw
        self.zstandard = zstandard
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.fed = False  # bytes given to the current frame's decompressor
        self.pending = b""  # compressed bytes not yet given to a decompressor
        self.out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.out:
            if not self.pending:
                self.pending = self.raw.read(ZSTD_CHUNK)
                if not self.pending:
                    if self.fed:
                        raise DamagedStream("the zstd stream ends inside a frame (cut short)")
                    return 0
            data, self.pending = self.pending, b""
            try:
                self.out = memoryview(self.frame.decompress(data))
            except self.zstandard.ZstdError as why:
                raise DamagedStream(f"zstd: {why}") from None
            self.fed = True
            if self.frame.eof:  # the frame ended: the next one starts with its unused bytes
                self.pending = self.frame.unused_data
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
                self.fed = False
        count = min(len(buffer), len(self.out))
        buffer[:count] = self.out[:count]
        self.out = self.out[count:]  # a view: no copy of the rest
        return count


def plan_jsonl(raw, url: str, kind: ObjectKind, object_version, size) -> ObjectPlan:
    """Counts the non-blank lines of the JSONL object `raw` (a binary stream), hashing its bytes
    and, for plain JSONL, noting the byte offset of every `BLOCK_ROWS`-th row.

    Raises:
        CorpusFormatError: a compressed stream cut short or garbled.
    """
    hashing = HashingReader(raw)
    rows = 0
    offsets = []
    offset = 0
    try:
        with decompressed(hashing, kind.compression, url) as lines:
            for line in lines:
                if line.strip():
                    if rows % BLOCK_ROWS == 0:
                        offsets.append(offset)
                    rows += 1
                offset += len(line)
    except DAMAGE as why:
        raise CorpusFormatError(f"{url} is damaged: {type(why).__name__}: {why}.") from None
    if kind.compression is not None:
        offsets = []  # no random access into a compressed stream
    return ObjectPlan(
        url=url,
        object_version=object_version,
        format="jsonl",
        compression=kind.compression,
        rows=rows,
        size=hashing.position,
        block_offsets=tuple(offsets),
        sha256=hashing.sha256.hexdigest(),
    )


def parquet_file(handle, url: str):
    """`pyarrow.parquet.ParquetFile` over `handle`, its footer read.

    Raises:
        CorpusFormatError: the footer does not parse.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(handle)
    except pa.ArrowException as why:
        raise CorpusFormatError(
            f"{url} is not a readable Parquet file (its footer does not parse: {why})."
        ) from None


def plan_parquet(handle, url: str, object_version, size, text_key: str) -> ObjectPlan:
    """The plan of a Parquet object from its footer: rows per row group.

    Raises:
        CorpusFormatError: the footer does not parse, or there is no `text_key` column.
    """
    meta = parquet_file(handle, url).metadata
    names = meta.schema.names
    if text_key not in names:
        raise CorpusFormatError(
            f"{url} has no column {text_key!r} (its columns: {names}); pass text_key=."
        )
    groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    return ObjectPlan(
        url=url,
        object_version=object_version,
        format="parquet",
        compression=None,
        rows=sum(groups),
        size=size,
        row_groups=groups,
    )


def parquet_rows(file, url: str, group: int, columns: Sequence[str]) -> list[dict]:
    """The rows of row group `group` of the opened Parquet `file`, of `columns`."""
    import pyarrow as pa

    try:
        return file.read_row_group(group, columns=list(columns)).to_pylist()
    except pa.ArrowException as why:
        raise CorpusFormatError(f"{url}: row group {group} does not read ({why}).") from None


def jsonl_lines(stream, url: str) -> Iterator[bytes]:
    """The non-blank lines of a decompressed JSONL stream; damage raised as `CorpusFormatError`."""
    try:
        for line in stream:
            if line.strip():
                yield line
    except DAMAGE as why:
        raise CorpusFormatError(f"{url} is damaged: {type(why).__name__}: {why}.") from None


def document(line: bytes, url: str, row: int, text_key: str, columns: Sequence[str]) -> dict:
    """Row `row` of a JSONL object as `{text_key: ..., column: ...}`.

    Raises:
        CorpusFormatError: not a JSON object, or without `text_key`.
    """
    try:
        record = json.loads(line)
    except ValueError as why:
        raise CorpusFormatError(f"{url}: row {row} is not JSON ({why}).") from None
    if not isinstance(record, dict) or text_key not in record:
        raise CorpusFormatError(
            f"{url}: row {row} has no {text_key!r} field; pass text_key= (the field of the text)."
        )
    return {name: record.get(name) for name in (text_key, *columns)}
