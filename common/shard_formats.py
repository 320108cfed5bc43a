"""One shard in an open format: WebDataset tar or Parquet, written byte for byte the same on any
machine, read by sample ranges.

Use when: writing or reading the shards of `recipes.common.shards` (`write_shards`, `ShardSet`),
or reading tars and Parquet files that other tools wrote (`read_tar`, `read_parquet`).
Samples follow WebDataset's convention: a dict with `"__key__"` and one entry per field, keyed
by extension. A field's value is stored as bytes: `bytes` as they are, `str` as UTF-8, `int`
as ASCII decimal (WebDataset's `.cls`), `dict`/`list` as JSON, a numpy array as `.npy` (no
pickle). `decode_sample` turns them back by extension, as WebDataset's basic decoders do.
Cost: a tar shard is its samples' members concatenated (512-byte headers, padded data): each
sample is encoded once to bytes, so its size and its offset in the shard are known before the
shard is written. A Parquet shard is one `pyarrow` table, in row groups.
Adapt here: `INT_FIELDS`, `TEXT_FIELDS`, `JSON_FIELDS` (what `decode_sample` decodes);
`ROW_GROUPS` (row groups per Parquet shard: the grain of a ranged read).
Trade-off: tar headers are fixed (mtime 0, uid/gid 0, mode 0444) so that the same samples give
the same bytes on every rank and every run; a key's basename may not contain "." (WebDataset
splits the key from the extension at the first dot).
Copy with: nothing.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

INT_FIELDS = ("cls", "cls2", "index", "id", "label")
TEXT_FIELDS = ("txt", "text", "caption")
JSON_FIELDS = ("json",)
ROW_GROUPS = 16
_BLOCK = 512
_RECORD = 20 * _BLOCK  # tarfile's record size: an archive ends padded to it


class ShardFormatError(ValueError):
    """A sample that cannot be stored, or a shard that does not read as its format."""


def sample_key(sample: Any, position: int) -> str:
    """The sample's `"__key__"`, checked.

    Raises:
        ShardFormatError: not a dict, no key, or a key WebDataset would split differently.
    """
    if not isinstance(sample, dict):
        raise ShardFormatError(f"sample {position} is a {type(sample).__name__}; write_shards takes dicts with "
                               "'__key__' and one entry per field (WebDataset's convention: {'__key__': 'a', "
                               "'jpg': b'...', 'cls': 3}).")
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ShardFormatError(f"sample {position} has no '__key__' (a non-empty str); got {key!r}.")
    if "." in os.path.basename(key) or key.endswith("/"):
        raise ShardFormatError(f"sample {position}: key {key!r} has a '.' in its last path part; WebDataset "
                               "readers split the key from the field at the first dot. Replace the dots.")
    if key.startswith("/") or "//" in key:
        raise ShardFormatError(f"sample {position}: key {key!r} starts with '/' or holds '//'; a tar member name "
                               "is a relative path, and readers would return another key. Use a relative key.")
    return key


def field_bytes(value: Any, key: str, field: str) -> bytes:
    """A field's value as stored: bytes, UTF-8 text, ASCII int, JSON or `.npy`.

    Raises:
        ShardFormatError: a value of another type, naming the key and the field.
    """
    ext = field.rsplit(".", 1)[-1]
    if isinstance(value, (bytes, bytearray, memoryview, str)) and ext in (*INT_FIELDS, *TEXT_FIELDS, *JSON_FIELDS):
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        try:  # what decode_sample will do with it: refused now, naming the sample, not at read time
            text = data.decode("utf-8")
            if ext in INT_FIELDS:
                int(text)
            elif ext in JSON_FIELDS:
                json.loads(text)
        except ValueError:
            kind = "an integer" if ext in INT_FIELDS else "JSON" if ext in JSON_FIELDS else "UTF-8 text"
            raise ShardFormatError(f"sample {key!r}, field {field!r}: {value[:40]!r} is not {kind}, which readers "
                                   f"decode a '.{ext}' field as; store it under another extension.") from None
        return data
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, np.bool_)):
        raise ShardFormatError(f"sample {key!r}, field {field!r}: a bool is ambiguous in a shard; store an int.")
    if isinstance(value, (int, np.integer)):
        return str(int(value)).encode("ascii")
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise ShardFormatError(f"sample {key!r}, field {field!r}: an object array needs pickle; store numbers.")
        out = io.BytesIO()
        np.save(out, value, allow_pickle=False)
        return out.getvalue()
    raise ShardFormatError(f"sample {key!r}, field {field!r}: cannot store a {type(value).__name__}; give bytes, "
                           "str, int, a dict/list (JSON) or a numpy array.")


def sample_fields(sample: dict, key: str) -> list[tuple[str, bytes]]:
    """`(field, stored bytes)` of every field but the key, in the sample's order.

    Raises:
        ShardFormatError: no fields, a field name that is not an extension, or a bad value.
    """
    fields = []
    for field, value in sample.items():
        if not isinstance(field, str):
            raise ShardFormatError(f"sample {key!r}: field {field!r} is a {type(field).__name__}; field names are "
                                   "extensions such as 'jpg' or 'cls'.")
        if field == "__key__" or (field.startswith("__") and field.endswith("__")):
            continue
        if not field or "/" in field or field.startswith("."):
            raise ShardFormatError(f"sample {key!r}: field {field!r} is not an extension such as 'jpg' or 'cls'.")
        fields.append((field, field_bytes(value, key, field)))
    if not fields:
        raise ShardFormatError(f"sample {key!r} has no fields besides '__key__'.")
    return fields


def decode_sample(sample: dict) -> dict:
    """Stored field bytes back to values by extension: ints, text, JSON, `.npy` arrays; other
    fields (images, audio) stay bytes for the domain decoders."""
    out = {}
    for field, value in sample.items():
        ext = field.rsplit(".", 1)[-1]
        if field.startswith("__") or not isinstance(value, (bytes, bytearray)):
            out[field] = value
        elif ext in INT_FIELDS:
            out[field] = int(value)
        elif ext in TEXT_FIELDS:
            out[field] = bytes(value).decode("utf-8")
        elif ext in JSON_FIELDS:
            out[field] = json.loads(value)
        elif ext == "npy":
            out[field] = np.load(io.BytesIO(value), allow_pickle=False)
        else:
            out[field] = bytes(value)
    return out


# ---- tar ------------------------------------------------------------------------------------
def tar_sample(key: str, fields: list[tuple[str, bytes]]) -> bytes:
    """The tar members of one sample (`key.field` each), headers fixed so that the bytes depend
    on the sample only (tarfile's PAX headers: a plain ustar header unless a name needs more)."""
    parts = []
    for field, data in fields:
        info = tarfile.TarInfo(f"{key}.{field}")
        info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o444, 0, 0
        info.uname = info.gname = ""
        parts += (info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"), data, b"\0" * (-len(data) % _BLOCK))
    return b"".join(parts)


def tar_end(size: int) -> bytes:
    """The end of an archive of `size` bytes of members: two zero blocks, then zeros up to a
    whole record, as tarfile writes it."""
    total = size + 2 * _BLOCK
    return b"\0" * (2 * _BLOCK + (-total) % _RECORD)


def read_tar(path, start: int = 0, stop: int | None = None, *, offsets: Sequence[int] | None = None,
             storage_options: dict | None = None) -> Iterator[dict]:
    """The samples `[start, stop)` of a WebDataset tar: members grouped by key (the name up to
    the first "." of its last path part), `{"__key__": key, field: bytes, ...}`.

    With `offsets` (each sample's first header, from the shard's index) only the range's bytes
    are read, in one read, and their headers parsed in memory; without, from the start, and the
    samples before `start` are read past. `path` is a local path or an fsspec URL.

    Raises:
        ShardFormatError: the file is not a tar, or its members of one key are not adjacent.
    """
    stop = None if stop is None else int(stop)
    if (stop is not None and stop <= start) or (offsets is not None and start >= len(offsets)):
        return
    begin = int(offsets[start]) if offsets is not None else 0
    end = int(offsets[stop]) if offsets is not None and stop is not None and stop < len(offsets) else None
    skip = 0 if offsets is not None else start
    with _open(path, storage_options) as raw:
        raw.seek(begin)
        data = raw.read() if end is None else raw.read(end - begin)
    try:
        members = list(_members(data))
    except _NotUstar:  # PAX or GNU long names, other tar dialects: tarfile reads them
        members = _tarfile_members(data, path)
    except ShardFormatError as error:
        raise ShardFormatError(f"{path} is not a tar file, or a damaged one ({error}).") from None
    count = None if stop is None else stop - start
    done = 0
    for sample in _group(members, path):
        if skip:
            skip -= 1
            continue
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


def _members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """`(name, bytes)` of the regular files in tar bytes with plain ustar/v7 headers; raises
    `_NotUstar` for extended headers (PAX, GNU long names) and `ShardFormatError` for damage."""
    view = memoryview(data)
    pos, n = 0, len(data)
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
            yield name.decode("utf-8", "surrogateescape"), bytes(view[body : body + size])
        pos = body + size + (-size % _BLOCK)
    if pos < n and data.count(0, pos) != n - pos:
        raise ShardFormatError(f"{n - pos} bytes at byte {pos} that are not a tar header")


def _tarfile_members(data: bytes, path) -> list[tuple[str, bytes]]:
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    except tarfile.ReadError as error:
        raise ShardFormatError(f"{path} is not a tar file ({error}).") from None


def _group(members, path) -> Iterator[dict]:
    """Samples from `(name, bytes)` members: adjacent members of one key, WebDataset's way."""
    current: dict | None = None
    seen: set[str] = set()
    for name, data in members:
        directory, base = os.path.split(name)
        if "." not in base:
            continue  # WebDataset ignores members without an extension
        stem, field = base.split(".", 1)
        key = f"{directory}/{stem}" if directory else stem
        if current is None or current["__key__"] != key:
            if current is not None:
                yield current
            if key in seen:
                raise ShardFormatError(f"{path}: the members of key {key!r} are not adjacent; a WebDataset tar "
                                       "groups each sample's files together.")
            seen.add(key)
            current = {"__key__": key}
        current[field] = data
    if current is not None:
        yield current


def scan_tar(path, storage_options: dict | None = None) -> tuple[int, list[int]]:
    """`(samples, each sample's first header offset)` of a tar, by one pass over its headers."""
    import fsspec

    offsets, last, seen = [], None, set()
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        try:
            tar = tarfile.open(fileobj=raw, mode="r:")
        except tarfile.ReadError as error:
            raise ShardFormatError(f"{path} is not a tar file ({error}).") from None
        for member in tar:
            directory, base = os.path.split(member.name)
            if not member.isfile() or "." not in base:
                continue
            key = f"{directory}/{base.split('.', 1)[0]}" if directory else base.split(".", 1)[0]
            if key != last:
                if key in seen:
                    raise ShardFormatError(f"{path}: the members of key {key!r} are not adjacent; a WebDataset tar "
                                           "groups each sample's files together (GNU tar: --sort=name).")
                seen.add(key)
                offsets.append(member.offset)
                last = key
    return len(offsets), offsets


# ---- parquet --------------------------------------------------------------------------------
def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError('Parquet shards need pyarrow: pip install "recipes[parquet]" (or pyarrow).') from None
    return pyarrow


def parquet_value(value: Any, key: str, field: str):
    """A field's value in its Parquet column: bytes, str and int as they are, dict/list as JSON text."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) or (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))):
        return value if isinstance(value, str) else int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    raise ShardFormatError(f"sample {key!r}, field {field!r}: a Parquet column takes bytes, str, int, float or "
                           f"JSON (dict/list), not a {type(value).__name__}.")


def parquet_shard(rows: list[dict], schema) -> bytes:
    """A Parquet file of `rows` (dicts with every schema column) in `ROW_GROUPS` row groups."""
    pa = _pyarrow()
    table = pa.Table.from_pylist(rows, schema=schema)
    out = pa.BufferOutputStream()
    pa.parquet.write_table(table, out, row_group_size=max(1, -(-len(rows) // ROW_GROUPS)))
    return out.getvalue().to_pybytes()


def parquet_schema(sample: dict, key: str):
    """The schema the first sample sets: `__key__` string, then one column per field."""
    pa = _pyarrow()
    types = [("__key__", pa.string())]
    for field, value in sample.items():
        if field == "__key__":
            continue
        value = parquet_value(value, key, field)
        kind = (pa.binary() if isinstance(value, bytes) else pa.string() if isinstance(value, str)
                else pa.int64() if isinstance(value, int) else pa.float64())
        types.append((field, kind))
    return pa.schema(types)


def read_parquet(path, start: int = 0, stop: int | None = None, *, columns: Sequence[str] | None = None,
                 storage_options: dict | None = None) -> Iterator[dict]:
    """The rows `[start, stop)` of a Parquet file as dicts, reading only the row groups that hold
    them (and only `columns`, when given). `path` is a local path or an fsspec URL."""
    import fsspec

    pa = _pyarrow()
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        try:
            file = pa.parquet.ParquetFile(raw)
        except pa.ArrowInvalid as error:
            raise ShardFormatError(f"{path} is not a Parquet file ({error}).") from None
        first = 0
        for group in range(file.num_row_groups):
            rows = file.metadata.row_group(group).num_rows
            lo, hi = max(start, first), rows + first if stop is None else min(stop, first + rows)
            if lo < hi:
                table = file.read_row_group(group, columns=list(columns) if columns else None)
                yield from table.slice(lo - first, hi - lo).to_pylist()
            first += rows
            if stop is not None and first >= stop:
                return


def parquet_rows(path, storage_options: dict | None = None) -> list[int]:
    """Rows per row group of a Parquet file (its footer only)."""
    import fsspec

    pa = _pyarrow()
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        try:
            meta = pa.parquet.ParquetFile(raw).metadata
        except pa.ArrowInvalid as error:
            raise ShardFormatError(f"{path} is not a Parquet file ({error}).") from None
        return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
