"""The local index of a corpus: one small JSON file per object, its plan (rows, Parquet row
groups, JSONL block offsets), keyed by the object's URL and version, never written beside it.

Use when: a corpus is opened again (another run, another rank) and its objects' footers or
first reads should not be fetched again, unless an object changed.
Cost: one JSON read per object on open; one atomic write (temp file, fsync, rename) per object
planned.
Adapt here: `FORMAT` and `VERSION` (bump on a layout change: older entries are planned again).
Trade-off: an entry per object, not one file for the corpus: ranks that plan at once write
disjoint files or the same content, and a changed object rewrites only its own entry.

An entry: `{"index_format": FORMAT, "index_version": VERSION, "entry_sha256": ...}` and the
`ObjectPlan`'s fields (`url`, `object_version`, `format`, `compression`, `rows`, `size`,
`row_groups`, `block_offsets`, `sha256`); one whose index format, version, URL or object
version differs from the object's now is ignored (planned again), as is one that does not parse,
whose fields are not a plan's, or whose checksum (`entry_sha256`, over the plan's fields) differs:
a damaged entry is planned again, never served. An index folder that cannot be written (read-only,
a file in its place) warns once and plans on without recording.
Copy with: common/caches/cache_files.py, common/remote/object_urls.py,
  common/workers/held_descriptors.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from recipes.common.caches.cache_files import write_synced
from recipes.common.remote.object_urls import cache_key

FORMAT = "recipes-corpus-object"
VERSION = 2  # 2: entries carry the checksum of their plan
FORMAT_KEY = "index_format"  # the header's keys, beside the plan's own fields
VERSION_KEY = "index_version"
CHECK_KEY = "entry_sha256"
FORMATS = {"parquet": (None,), "jsonl": (None, "gzip", "zstd")}  # formats and their compressions
_unwritable: set[str] = set()  # index folders already warned about


@dataclass(frozen=True)
class ObjectPlan:
    """What a read of one object needs: its `rows`; for Parquet, rows per row group; for plain
    JSONL, the byte offset of every `block_rows`-th row; for JSONL, the sha256 of its bytes (the
    cache verifies its copies with it); the object's `size` and `object_version` when planned."""

    url: str
    object_version: str | None
    format: str
    compression: str | None
    rows: int
    size: int
    row_groups: tuple[int, ...] = ()
    block_offsets: tuple[int, ...] = ()
    sha256: str | None = None


def default_index_dir() -> Path:
    """`$RECIPES_CORPUS_DIR`, else `$XDG_CACHE_HOME/recipes/corpora` (`~/.cache/...`)."""
    folder = os.environ.get("RECIPES_CORPUS_DIR")
    if folder:
        return Path(folder)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "recipes" / "corpora"


def entry_path(folder: Path, url: str) -> Path:
    return Path(folder) / f"{cache_key(url)}.json"


def load_plan(folder: Path, url: str, object_version: str | None) -> ObjectPlan | None:
    """The plan recorded for `url` at `object_version`, or None (none, another version, another
    layout, or a damaged entry: the object is planned again)."""
    if object_version is None:
        return None
    try:
        entry = json.loads(entry_path(folder, url).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(entry, dict) or entry.pop(FORMAT_KEY, None) != FORMAT:
        return None
    if entry.pop(VERSION_KEY, None) != VERSION:
        return None
    if entry.pop(CHECK_KEY, None) != _checksum(entry):
        return None
    try:
        plan = ObjectPlan(**entry)
    except TypeError:
        return None
    if plan.url != url or plan.object_version != object_version:
        return None
    if not _well_formed(plan):
        return None
    return ObjectPlan(
        **{
            **entry,
            "row_groups": tuple(plan.row_groups),
            "block_offsets": tuple(plan.block_offsets),
        }
    )


def save_plan(folder: Path, plan: ObjectPlan) -> None:
    """Records `plan` atomically (a reader sees the old entry or the new one, never a part); a
    folder that cannot be written warns once and records nothing (the plan is made again on the
    next open)."""
    if plan.object_version is None:  # nothing to key it by: planned again on every open
        return
    folder = Path(folder)
    fields = asdict(plan)
    entry = {FORMAT_KEY: FORMAT, VERSION_KEY: VERSION, CHECK_KEY: _checksum(fields), **fields}
    data = json.dumps(entry, sort_keys=True).encode("utf-8")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    except OSError as why:
        _warn_unwritable(folder, why)
        return
    os.close(fd)
    try:
        write_synced(Path(temp), data)
        os.replace(temp, entry_path(folder, plan.url))
    except BaseException as why:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        if isinstance(why, OSError):
            _warn_unwritable(folder, why)
            return
        raise


def _checksum(fields: dict) -> str:
    """The sha256 of a plan's fields as JSON (keys sorted)."""
    data = json.dumps(fields, sort_keys=True).encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def _counts(values) -> bool:
    return isinstance(values, (list, tuple)) and all(_count(v) for v in values)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _well_formed(plan: ObjectPlan) -> bool:
    """Whether an entry's fields are a plan's: counts are counts, the format is one read."""
    if plan.format not in FORMATS or plan.compression not in FORMATS[plan.format]:
        return False
    if not (_count(plan.rows) and _counts(plan.row_groups) and _counts(plan.block_offsets)):
        return False
    if plan.size is not None and not _count(plan.size):
        return False
    if plan.format == "parquet" and sum(plan.row_groups) != plan.rows:
        return False
    return plan.sha256 is None or isinstance(plan.sha256, str)


def _warn_unwritable(folder: Path, why: OSError) -> None:
    if str(folder) in _unwritable:
        return
    _unwritable.add(str(folder))
    warnings.warn(
        f"The corpus index {folder} cannot be written ({type(why).__name__}: {why}): plans are "
        "not recorded, and are made again on every open. Pass a writable index_dir= (or set "
        "RECIPES_CORPUS_DIR).",
        stacklevel=3,
    )
