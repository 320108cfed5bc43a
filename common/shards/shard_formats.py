"""One shard in an open format: WebDataset tar or Parquet, written byte for byte the same on any
machine, read by sample ranges.

Use when: writing or reading the shards of `recipes.common.shards.shard_set` (`write_shards`,
`ShardSet`), or reading tars and Parquet files that other tools wrote (`read_tar`, `read_parquet`).
What a sample's fields become as bytes, and back, is `recipes.common.shards.shard_samples`'s;
a tar's members as bytes (written, parsed, grouped by key) are `tar_members.py`'s.
Cost: a tar shard is its samples' members concatenated (512-byte headers, padded data): each
sample is encoded once to bytes, so its size and its offset in the shard are known before the
shard is written; a ranged read reads its range's bytes in one read. A Parquet shard is one
`pyarrow` table, in row groups.
Adapt here: `ROW_GROUPS` (row groups per Parquet shard: the grain of a ranged read).
Trade-off: tar headers are fixed (mtime 0, uid/gid 0, mode 0444) so that the same samples give
the same bytes on every rank and every run. Readers refuse what WebDataset refuses or would
read another way: a member twice in one sample, a key's members apart, a zero-byte file.
Copy with: common/shards/shard_samples.py, common/shards/tar_members.py.
"""

from __future__ import annotations

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
from recipes.common.shards.tar_members import (
    BLOCK,
    NotUstar,
    check_new_key,
    duplicate_member,
    group_samples,
    key_field,
    tar_members,
    tarfile_members,
)

ROW_GROUPS = 16


# ---- tar ------------------------------------------------------------------------------------
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
    if stop is not None:
        stop = int(stop)
        if stop <= start:
            return
    begin = 0
    skip = start  # without offsets, the samples before `start` are read past
    if offsets is not None:
        if start >= len(offsets):
            return
        begin = int(offsets[start])
        skip = 0
        if stop is not None and stop < len(offsets):
            end = int(offsets[stop])
    with _open(path, storage_options) as raw:
        raw.seek(begin)
        if end is None:
            data = raw.read()
        else:
            data = raw.read(max(0, end - begin))
    if not data and begin == 0:
        raise ShardFormatError(
            f"{path} is empty (0 bytes), which is not a tar file: an upload or a copy that "
            "failed? Rewrite it (an archive without samples still has its end blocks)."
        )
    if check is not None:
        check(data, begin)
    try:
        members = list(tar_members(data))
    except NotUstar:  # PAX or GNU long names, other tar dialects: tarfile reads them
        members = tarfile_members(data, path)
    except ShardFormatError as error:
        raise ShardFormatError(f"{path} is not a tar file, or a damaged one ({error}).") from None
    done = 0
    for at, sample in group_samples(members, path):
        if skip:
            skip -= 1
            continue
        if offsets is not None and (
            start + done >= len(offsets) or begin + at != int(offsets[start + done])
        ):
            expected = "none"
            if start + done < len(offsets):
                expected = int(offsets[start + done])
            raise ShardFormatError(
                f"{path}: sample {start + done} ({sample['__key__']!r}) starts at byte "
                f"{begin + at:,}, but its index says {expected}: damaged, or not the shard the "
                "index was made of. Rewrite the shards (or re-index them)."
            )
        yield sample
        done += 1
        if stop is not None and done >= stop - start:
            return


def _open(path, storage_options):
    if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(path, "rb", **(storage_options or {})).open()


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
                end = member.offset_data + member.size + (-member.size % BLOCK)
                key, field = key_field(member.name)
                if not member.isfile() or key is None:
                    continue
                if key != last:
                    check_new_key(key, seen, path)
                    offsets.append(member.offset)
                    last = key
                    fields = set()
                if field in fields:
                    raise duplicate_member(path, member.name)
                fields.add(field)
        except tarfile.TarError as error:
            empty = ""
            if "empty file" in str(error):
                empty = " (0 bytes)"
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
        # what readers decode it as: refused now if it does not decode
        stored.text_bytes(value, key, field)
        if isinstance(value, str):
            return value
        return bytes(value)
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
        types.append((field, _column_type(pa, parquet_value(value, key, field))))
    return pa.schema(types)


def _column_type(pa, value):
    """The Parquet type of a column whose first value (`parquet_value`'s) is `value`."""
    if isinstance(value, bytes):
        return pa.binary()
    if isinstance(value, str):
        return pa.string()
    if isinstance(value, int):
        return pa.int64()
    return pa.float64()


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
    wanted = None
    if columns:
        wanted = list(columns)
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
                hi = first + rows
                if stop is not None:
                    hi = min(stop, hi)
                if lo < hi:
                    table = file.read_row_group(group, columns=wanted)
                    if check is not None:
                        check(group, table)
                    yield from table.slice(lo - first, hi - lo).to_pylist()
                first += rows
                if stop is not None and first >= stop:
                    return
    except (ShardFormatError, FileNotFoundError, PermissionError):
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as error:
        where = "its footer"
        if group is not None:
            where = f"row group {group}"
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
