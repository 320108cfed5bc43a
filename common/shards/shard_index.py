"""A shard set's index (`index.json`): its layout's constants, and its own consistency checked
when it is opened.

Use when: reading or writing the index of `ShardSet` / `write_shards` / `index_shards`: the
format's name and version, the entry key of the per-sample checksums (`SUMS`), `new_index`
(what a writer publishes), and `check_index` / `check_versioned`, which refuse an index that
disagrees with itself (counts with offsets, row groups and checksums; offsets that start
samples in order inside the shard; names used once) before any shard is read.
Cost: one pass over the index's entries (a few integers per sample), once per `ShardSet.open`.
Adapt here: nothing; raise `VERSION` when an entry's meaning changes.
Trade-off: a v1 index (written before the checksums) still reads, with a warning: its samples
are checked against their counts and offsets, not their bytes; one whose entries carry the v2
checksums is refused as damaged (its version was changed, which would turn the checks off).
Copy with: common/shards/shard_samples.py.
"""

from __future__ import annotations

import warnings

from recipes.common.shards.shard_samples import ShardFormatError

INDEX_NAME = "index.json"
SUMS = "xxh3"  # an entry's key for its checksums
_LIMIT = 2**64

FORMAT = "recipes-shards"
VERSION = 2  # 2: per-sample xxh3-64s (`xxh3`) and tar `end`
VERSIONS = (1, 2)  # the versions that read (1 unverified, with a warning)


class ShardIndexError(ShardFormatError):
    """An index that is missing, damaged, of another version, or disagrees with its shards (a
    `ShardFormatError` too, and a `ValueError`: one `except ShardFormatError` catches both)."""


def new_index(
    shard_format: str, entries: list[dict], columns: list[list[str]] | None, where: str
) -> dict:
    """A version-`VERSION` index of the shards' `entries`. `columns`: `[name, type]` per Parquet
    column, or None where each entry lists its own (`index_shards`: Parquet files of others),
    which must agree.

    Raises:
        ShardFormatError: Parquet files of different columns (naming `where`, their folder).
    """
    index = {
        "format": FORMAT,
        "version": VERSION,
        "shard_format": shard_format,
        "samples": int(sum(e["samples"] for e in entries)),
        "shards": entries,
    }
    if columns is not None:
        index["columns"] = columns
    elif shard_format == "parquet":  # index_shards: others' files, one schema
        index["columns"] = []
        if entries:
            index["columns"] = entries[0].pop("columns")
        if any(e.pop("columns", index["columns"]) != index["columns"] for e in entries):
            raise ShardFormatError(
                f"the Parquet files under {where} have different columns; an index "
                "describes one schema. Index each schema's files apart."
            )
    return index


def check_index(index, path: str) -> None:
    """Everything an index states about itself agrees: counts with offsets, row groups and
    checksums, offsets that start samples in order inside the shard, names used once.

    Raises:
        ShardIndexError: naming the index and, for a shard entry, the shard.
    """
    rebuild = "rebuild it with index_shards() or rewrite the shards"
    if (
        not isinstance(index, dict)
        or index.get("format") != FORMAT
        or index.get("version") not in VERSIONS
    ):
        raise ShardIndexError(f"{path} is not a {FORMAT} index of version {VERSIONS}; {rebuild}.")
    shards = index.get("shards")
    kind = index.get("shard_format")
    if (
        kind not in ("tar", "parquet")
        or not isinstance(shards, list)
        or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and _count(e.get("samples"))
            for e in shards
        )
    ):
        raise ShardIndexError(
            f"{path} is incomplete or damaged (no shard_format, or a shard entry without its "
            f"name and sample count); {rebuild}."
        )
    names = [e["name"] for e in shards]
    if len(set(names)) != len(names) or any("/" in n or not n for n in names):
        raise ShardIndexError(f"{path} names a shard twice, or by a path: damaged; {rebuild}.")
    columns = index.get("columns")
    if (
        kind == "parquet"
        and (index["version"] > 1 or columns is not None)
        and not (
            isinstance(columns, list)
            and columns
            and all(
                isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c)
                for c in columns
            )
        )
    ):
        raise ShardIndexError(
            f"{path} has no valid `columns` (name and type per Parquet column); {rebuild}."
        )
    for entry in shards:
        if kind == "tar":
            problem = _tar_problem(entry)
        else:
            problem = _parquet_problem(entry, columns)
        if problem is None and index["version"] > 1 and not isinstance(entry.get("bytes"), int):
            problem = "has no byte size"
        if problem is not None:
            raise ShardIndexError(
                f"{path}: the entry of shard {entry['name']} {problem}: damaged, or not the index "
                f"of these shards; {rebuild}."
            )
    if not _count(index.get("samples")) or index["samples"] != sum(e["samples"] for e in shards):
        raise ShardIndexError(
            f"{path} says {index.get('samples')!r} samples, but its shards' counts add up to "
            f"{sum(e['samples'] for e in shards)}: damaged; {rebuild}."
        )


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(values, length: int | None = None) -> bool:
    return (
        isinstance(values, list)
        and (length is None or len(values) == length)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    )


def _tar_problem(entry: dict) -> str | None:
    offsets = entry.get("offsets")
    n = entry["samples"]
    size = entry.get("bytes")
    if not _ints(offsets):
        kind = "no offsets"
        if isinstance(offsets, list):
            kind = "offsets that are not all integers"
        return f"has {kind} (each sample's first tar header, in bytes)"
    if len(offsets) != n:
        return f"says {n} samples but lists {len(offsets)} offsets"
    if offsets and (
        offsets[0] < 0
        or any(b <= a for a, b in zip(offsets, offsets[1:], strict=False))
        or any(o % 512 for o in offsets)
    ):
        return "has offsets that are not increasing tar block boundaries (each starts a new sample)"
    if isinstance(size, int) and offsets and offsets[-1] + 512 > size:
        return f"has an offset past its size ({size:,} bytes)"
    if SUMS not in entry and "end" not in entry:
        return None  # a v1 entry (the version check requires them in v2)
    end = entry.get("end")
    crcs = entry.get(SUMS)
    last = 0  # where the last sample's header ends
    if offsets:
        last = offsets[-1] + 512
    if (
        not isinstance(end, int)
        or end < last
        or (isinstance(size, int) and end > size)
        or end % 512
    ):
        return f"has an `end` ({end!r}) before its last sample or past its size"
    if not _ints(crcs, n) or any(not 0 <= c < _LIMIT for c in crcs):
        listed = "no"
        if isinstance(crcs, list):
            listed = len(crcs)
        return f"says {n} samples but lists {listed} checksums"
    return None


def _parquet_problem(entry: dict, columns) -> str | None:
    groups = entry.get("row_groups")
    n = entry["samples"]
    if not _ints(groups) or any(g < 0 for g in groups) or sum(groups) != n:
        return f"says {n} samples, but its row groups ({groups!r}) do not add up to it"
    if SUMS not in entry:
        return None
    crcs = entry[SUMS]
    if (
        columns is None
        or not isinstance(crcs, list)
        or len(crcs) != len(groups)
        or not all(_ints(c, len(columns)) and all(0 <= x < _LIMIT for x in c) for c in crcs)
    ):
        return f"does not list a checksum per row group ({len(groups)}) and column ({len(columns)})"
    return None


def check_versioned(index: dict, path: str) -> None:
    """A v2 index must carry the checksums; a v1 index reads, with a warning that says what it
    lacks."""
    if index["version"] == 1 and any(SUMS in e or "end" in e for e in index["shards"]):
        raise ShardIndexError(
            f"{path} is damaged: a version-1 index with version-2 checksums (`xxh3`, `end`), "
            "so its version was changed and its checks would be skipped; rebuild it with "
            "index_shards() or rewrite the shards."
        )
    if index["version"] >= 2:
        missing = [
            e["name"]
            for e in index["shards"]
            if SUMS not in e or (index["shard_format"] == "tar" and "end" not in e)
        ]
        if missing:
            raise ShardIndexError(
                f"{path}: the entry of shard {missing[0]} has no `xxh3` checksums, which a "
                f"v{index['version']} index holds for every shard: damaged; rebuild it with "
                "index_shards() or rewrite the shards."
            )
        return
    warnings.warn(
        f"{path} is a v1 shard index: samples are checked against its counts and offsets, not "
        "their bytes (no per-sample checksums). Rebuild it with index_shards() (`recipes shards "
        "index`) to verify every sample read.",
        stacklevel=3,
    )
