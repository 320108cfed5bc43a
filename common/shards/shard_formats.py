"""One shard in an open format: WebDataset tar or Parquet, written byte for byte the same on any
machine, read by sample ranges.

Use when: writing or reading the shards of `recipes.common.shards.shard_set` (`write_shards`,
`ShardSet`), or reading tars and Parquet files that other tools wrote (`read_tar`, `read_parquet`).
What a sample's fields become as bytes, and back, is `recipes.common.shards.shard_samples`'s.
Cost: a tar shard is its samples' members concatenated (512-byte headers, padded data): each
sample is encoded once to bytes, so its size and its offset in the shard are known before the
shard is written. A Parquet shard is one `pyarrow` table, in row groups.
Adapt here: `ROW_GROUPS` (row groups per Parquet shard: the grain of a ranged read).
Trade-off: tar headers are fixed (mtime 0, uid/gid 0, mode 0444) so that the same samples give
the same bytes on every rank and every run. Readers refuse what WebDataset refuses or would
read another way: a member twice in one sample, a key's members apart, a zero-byte file.
Copy with: common/shards/shard_samples.py.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import recipes.common.shards.shard_samples as stored
from recipes.common.shards.shard_samples import ShardFormatError, check_codec, check_field_name
from recipes.common.shards.shard_samples import (
    decode_sample as decode_sample,  # re-exported: read_tar's samples decoded
)

ROW_GROUPS = 16
_BLOCK = 512
_RECORD = 20 * _BLOCK  # tarfile's record size: an archive ends padded to it


# ---- tar ------------------------------------------------------------------------------------
def tar_sample(key: str, fields: list[tuple[str, bytes]]) -> bytes:
    """The tar members of one sample (`key.field` each), headers fixed so that the bytes depend
    on the sample only (tarfile's PAX headers: a plain ustar header unless a name needs more)."""
    parts = []
    for field, data in fields:
        info = tarfile.TarInfo(f"{key}.{field}")
        info.size = len(data)
        info.mtime = 0
        info.mode = 0o444
        info.uid = 0
        info.gid = 0
        info.uname = info.gname = ""
        parts += (
            info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"),
            data,
            b"\0" * (-len(data) % _BLOCK),
        )
    return b"".join(parts)


def tar_end(size: int) -> bytes:
    """The end of an archive of `size` bytes of members: two zero blocks, then zeros up to a
    whole record, as tarfile writes it."""
    total = size + 2 * _BLOCK
    return b"\0" * (2 * _BLOCK + (-total) % _RECORD)


def read_tar(
    path,
    start: int = 0,
    stop: int | None = None,
    *,
    offsets: Sequence[int] | None = None,
    end: int | None = None,
    check=None,
    storage_options: dict | None = None,
) -> Iterator[dict]:
    """The samples `[start, stop)` of a WebDataset tar: members grouped by key (the name up to
    the first "." of its last path part), `{"__key__": key, field: bytes, ...}`.

    With `offsets` (each sample's first header, from the shard's index) only the range's bytes
    are read, in one read, and their headers parsed in memory, and each sample must start at its
    offset; `end` (the byte after the last sample) ends the last range; `check(data, begin)` is
    called on the bytes read (from byte `begin`) before they are parsed (the index's checksums).
    Without offsets, from the start, and the samples before `start` are read past. `path` is a
    local path or an fsspec URL.

    Raises:
        ShardFormatError: the file is not a tar (a zero-byte file is not), a member twice in one
            sample, the members of one key not adjacent, or a sample not where `offsets` says.
    """
    stop = None if stop is None else int(stop)
    if (stop is not None and stop <= start) or (offsets is not None and start >= len(offsets)):
        return
    begin = int(offsets[start]) if offsets is not None else 0
    if offsets is not None and stop is not None and stop < len(offsets):
        end = int(offsets[stop])
    skip = 0 if offsets is not None else start
    with _open(path, storage_options) as raw:
        raw.seek(begin)
        data = raw.read() if end is None else raw.read(max(0, end - begin))
    if not data and begin == 0:
        raise ShardFormatError(
            f"{path} is empty (0 bytes), which is not a tar file: an upload or a copy that "
            "failed? Rewrite it (an archive without samples still has its end blocks)."
        )
    if check is not None:
        check(data, begin)
    try:
        members = list(_members(data))
    except _NotUstar:  # PAX or GNU long names, other tar dialects: tarfile reads them
        members = _tarfile_members(data, path)
    except ShardFormatError as error:
        raise ShardFormatError(f"{path} is not a tar file, or a damaged one ({error}).") from None
    count = None if stop is None else stop - start
    done = 0
    for at, sample in _group(members, path):
        if skip:
            skip -= 1
            continue
        if offsets is not None and (
            start + done >= len(offsets) or begin + at != int(offsets[start + done])
        ):
            expected = int(offsets[start + done]) if start + done < len(offsets) else "none"
            raise ShardFormatError(
                f"{path}: sample {start + done} ({sample['__key__']!r}) starts at byte "
                f"{begin + at:,}, but its index says {expected}: damaged, or not the shard the "
                "index was made of. Rewrite the shards (or re-index them)."
            )
        yield sample
        done += 1
        if count is not None and done >= count:
            return


def _open(path, storage_options):
    if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(path, "rb", **(storage_options or {})).open()


class _NotUstar(Exception):
    pass


def tar_key_starts(data: bytes) -> tuple[list[int], int]:
    """Where each key's first member header starts in tar bytes (`read_tar`'s grouping; an
    extended header counts as its member's), and the byte up to which that is known: all of the
    data, or up to the last header before one that does not parse (damage: the checksums say so)."""
    found: list[tuple[int, str]] = []
    try:
        for at, name, _ in _members(data, bodies=False):
            found.append((at, name))
        known = len(data)
    except _NotUstar:
        found, known = _tarfile_names(data)
    except ShardFormatError:
        known = found[-1][0] + 1 if found else 0
    starts = []
    last = None
    for at, name in found:
        key = _key_field(name)[0]
        if key is not None and key != last:
            starts.append(at)
            last = key
    return starts, known


def tar_header_at(data: bytes, pos: int) -> bool | None:
    """Whether a tar header starts at `pos`: True, False, or None for a damaged one (the ustar
    magic, but a header checksum that fails) or the end of the data."""
    header = data[pos : pos + _BLOCK]
    field = header[148:156].split(b"\0", 1)[0].strip()
    if (
        len(header) == _BLOCK
        and header.count(0) != _BLOCK
        and field
        and set(field) <= set(b"01234567")
        and int(field, 8) == sum(header[:148]) + 8 * 32 + sum(header[156:_BLOCK])
    ):
        return True
    return None if len(header) < _BLOCK or header[257:262] == b"ustar" else False


def _tarfile_names(data: bytes) -> tuple[list[tuple[int, str]], int]:
    found: list[tuple[int, str]] = []
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        found = [(m.offset, m.name) for m in tar if m.isfile()]
    except tarfile.TarError:
        return found, 0
    clean = (
        data.count(0, tar.offset) == len(data) - tar.offset
    )  # tarfile stops quietly at a damaged header
    return found, len(data) if clean else (found[-1][0] + 1 if found else 0)


def _members(data: bytes, bodies: bool = True) -> Iterator[tuple[int, str, bytes | None]]:
    """`(header offset, name, bytes)` of the regular files in tar bytes with plain ustar/v7 headers;
    raises `_NotUstar` for extended headers (PAX, GNU long names) and `ShardFormatError` for damage.
    """
    view = memoryview(data)
    pos = 0
    n = len(data)
    while pos + _BLOCK <= n:
        header = data[pos : pos + _BLOCK]
        if header[0] == 0 and header.count(0) == _BLOCK:
            return  # the end-of-archive blocks
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            raise _NotUstar
        stored = sum(header[:148]) + 8 * 32 + sum(header[156:_BLOCK])
        try:
            checksum = int(header[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
            size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            raise ShardFormatError(f"a damaged tar header at byte {pos}") from None
        if checksum != stored:
            raise ShardFormatError(f"a damaged tar header at byte {pos} (checksum)")
        name = header[:100].split(b"\0", 1)[0]
        if header[257:262] == b"ustar" and header[345]:
            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
        body = pos + _BLOCK
        if body + size > n:
            raise ShardFormatError(f"a tar member at byte {pos} runs past the end of the data")
        if kind in (b"0", b"\0", b"7"):
            yield (
                pos,
                name.decode("utf-8", "surrogateescape"),
                bytes(view[body : body + size]) if bodies else None,
            )
        pos = body + size + (-size % _BLOCK)
    if pos < n and data.count(0, pos) != n - pos:
        raise ShardFormatError(f"{n - pos} bytes at byte {pos} that are not a tar header")


def _tarfile_members(data: bytes, path) -> list[tuple[int, str, bytes]]:
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        return [(m.offset, m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    except tarfile.ReadError as error:
        raise ShardFormatError(f"{path} is not a tar file ({error}).") from None


def _group(members, path) -> Iterator[tuple[int, dict]]:
    """`(first header offset, sample)` from `(offset, name, bytes)` members: adjacent members of
    one key, WebDataset's way."""
    current: dict | None = None
    seen: set[str] = set()
    first = 0
    for at, name, data in members:
        key, field = _key_field(name)
        if key is None:
            continue  # WebDataset ignores members without an extension
        if current is None or current["__key__"] != key:
            if current is not None:
                yield first, current
            _check_new_key(key, seen, path)
            current = {"__key__": key}
            first = at
        if field in current:
            raise _duplicate(path, name)
        current[field] = data
    if current is not None:
        yield first, current


def _key_field(name: str) -> tuple[str | None, str]:
    directory, base = os.path.split(name)
    if "." not in base:
        return None, ""
    stem, field = base.split(".", 1)
    return (f"{directory}/{stem}" if directory else stem), field


def _check_new_key(key: str, seen: set, path) -> None:
    if key in seen:
        raise ShardFormatError(
            f"{path}: the members of key {key!r} are not adjacent; a WebDataset tar groups each "
            "sample's files together (GNU tar: --sort=name)."
        )
    seen.add(key)


def _duplicate(path, name: str) -> ShardFormatError:
    return ShardFormatError(
        f"{path}: the member {name!r} appears twice in one sample (webdataset refuses it as a "
        "duplicate file name; which copy is the sample's?). Rewrite the shard with one each."
    )


def scan_tar(path, storage_options: dict | None = None) -> tuple[int, list[int], int]:
    """`(samples, each sample's first header offset, the byte after the last member)` of a tar,
    by one pass over its headers.

    Raises:
        ShardFormatError: as `read_tar` (a zero-byte file, a member twice in one sample, ...).
    """
    import fsspec

    offsets = []
    fields = set()
    seen = set()
    end = 0
    last = None
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        try:
            tar = tarfile.open(fileobj=raw, mode="r:")
            for member in tar:
                end = member.offset_data + member.size + (-member.size % _BLOCK)
                key, field = _key_field(member.name)
                if not member.isfile() or key is None:
                    continue
                if key != last:
                    _check_new_key(key, seen, path)
                    offsets.append(member.offset)
                    last = key
                    fields = set()
                if field in fields:
                    raise _duplicate(path, member.name)
                fields.add(field)
        except tarfile.TarError as error:
            empty = " (0 bytes)" if "empty file" in str(error) else ""
            raise ShardFormatError(
                f"{path} is not a tar file{empty}, or a damaged one ({error})."
            ) from None
    return len(offsets), offsets, end


# ---- parquet --------------------------------------------------------------------------------
def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            'Parquet shards need pyarrow: pip install "loader-recipes[parquet]" (or pyarrow).'
        ) from None
    return pyarrow


def parquet_value(value: Any, key: str, field: str):
    """A field's value in its Parquet column: bytes, str and int as they are, dict/list as JSON text
    (under a JSON field only: readers decode it back by extension). Text or bytes under a field
    that readers decode are checked as the tar writer checks them (one rule for both formats).
    """
    if isinstance(value, (dict, list)):
        check_codec(value, key, field)
        return stored.json_text(value, key, field)
    if (
        isinstance(value, (bytes, bytearray, memoryview, str))
        and field.rsplit(".", 1)[-1] in stored.DECODED
    ):
        stored.text_bytes(
            value, key, field
        )  # what readers decode it as: refused now if it does not decode
        return value if isinstance(value, str) else bytes(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        stored.utf8(value, key, field)  # pyarrow's UnicodeEncodeError, named
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return stored.fits_64_bits(int(value), key, field)
    if isinstance(value, (float, np.floating)):
        return float(value)
    raise ShardFormatError(
        f"sample {key!r}, field {field!r}: a Parquet column takes bytes, str, int, float or "
        f"JSON (dict/list), not a {type(value).__name__}."
    )


def parquet_shard(rows: list[dict], schema) -> bytes:
    """A Parquet file of `rows` (dicts with every schema column) in `ROW_GROUPS` row groups."""
    pa = _pyarrow()
    table = pa.Table.from_pylist(rows, schema=schema)
    out = pa.BufferOutputStream()
    pa.parquet.write_table(table, out, row_group_size=max(1, -(-len(rows) // ROW_GROUPS)))
    return out.getvalue().to_pybytes()


def parquet_schema(sample: dict, key: str):
    """The schema the first sample sets: `__key__` string, then one column per field (`{}`: an
    empty write's, `__key__` only)."""
    pa = _pyarrow()
    types = [("__key__", pa.string())]
    for field, value in sample.items():
        if field == "__key__":
            continue
        if not isinstance(field, str):
            raise ShardFormatError(
                f"sample {key!r}: field {field!r} is a {type(field).__name__}; column names are "
                "strings."
            )
        check_field_name(field, key)
        value = parquet_value(value, key, field)
        kind = (
            pa.binary()
            if isinstance(value, bytes)
            else pa.string()
            if isinstance(value, str)
            else pa.int64()
            if isinstance(value, int)
            else pa.float64()
        )
        types.append((field, kind))
    return pa.schema(types)


def read_parquet(
    path,
    start: int = 0,
    stop: int | None = None,
    *,
    columns: Sequence[str] | None = None,
    row_groups: Sequence[int] | None = None,
    check=None,
    storage_options: dict | None = None,
) -> Iterator[dict]:
    """The rows `[start, stop)` of a Parquet file as dicts, reading only the row groups that hold
    them (and only `columns`, when given). `path` is a local path or an fsspec URL. With
    `row_groups` (rows per group, from an index) the file's must be the same; `check(group,
    table)` is called on each row group read before its rows are yielded.

    Raises:
        ShardFormatError: a file that does not read as Parquet (pyarrow's error wrapped, naming
            the file and the row group), or whose row groups differ from `row_groups`.
    """
    import fsspec

    pa = _pyarrow()
    group = None
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as raw:
            file = pa.parquet.ParquetFile(raw)
            counts = [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)]
            if row_groups is not None and counts != [int(n) for n in row_groups]:
                raise ShardFormatError(
                    f"{path} has row groups of {counts} rows, but its index says "
                    f"{list(row_groups)}: damaged, or rewritten since the index was read. Rewrite "
                    "the shards (or re-index them)."
                )
            first = 0
            for group, rows in enumerate(counts):
                lo = max(start, first)
                hi = rows + first if stop is None else min(stop, first + rows)
                if lo < hi:
                    table = file.read_row_group(group, columns=list(columns) if columns else None)
                    if check is not None:
                        check(group, table)
                    yield from table.slice(lo - first, hi - lo).to_pylist()
                first += rows
                if stop is not None and first >= stop:
                    return
    except (ShardFormatError, FileNotFoundError, PermissionError):
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as error:
        where = "its footer" if group is None else f"row group {group}"
        raise ShardFormatError(
            f"{path} does not read as Parquet at {where}: damaged, or not a Parquet file "
            f"({type(error).__name__}: {str(error)[:200]})."
        ) from error


def parquet_rows(path, storage_options: dict | None = None) -> list[int]:
    """Rows per row group of a Parquet file (its footer only)."""
    import fsspec

    pa = _pyarrow()
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        try:
            meta = pa.parquet.ParquetFile(raw).metadata
        except (pa.ArrowException, OSError) as error:
            raise ShardFormatError(
                f"{path} is not a Parquet file, or a damaged one ({error})."
            ) from None
        return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
