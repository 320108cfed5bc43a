"""The local index of a corpus: one small JSON file per object, its plan (rows, Parquet row
groups, JSONL block offsets), keyed by the object's URL and version, never written beside it.

Use when: a corpus is opened again (another run, another rank) and its objects' footers or
first reads should not be fetched again, unless an object changed.
Cost: one JSON read per object on open; one atomic write (temp file, fsync, rename) per object
planned.
Adapt here: `FORMAT` and `VERSION` (bump on a layout change: older entries are planned again).
Trade-off: an entry per object, not one file for the corpus: ranks that plan at once write
disjoint files or the same content, and a changed object rewrites only its own entry.

An entry: `{"index_format": FORMAT, "index_version": VERSION}` and the `ObjectPlan`'s fields
(`url`, `object_version`, `format`, `compression`, `rows`, `size`, `row_groups`, `block_offsets`,
`sha256`); one whose index format, version, URL or object
version differs from the object's now is ignored (planned again), as is one that does not parse.
Copy with: common/caches/cache_files.py, common/remote/object_urls.py,
  common/workers/held_descriptors.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from recipes.common.caches.cache_files import write_synced
from recipes.common.remote.object_urls import cache_key

FORMAT = "recipes-corpus-object"
VERSION = 1
FORMAT_KEY = "index_format"  # the header's keys, beside the plan's own fields
VERSION_KEY = "index_version"


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
    try:
        plan = ObjectPlan(**entry)
    except TypeError:
        return None
    if plan.url != url or plan.object_version != object_version:
        return None
    return ObjectPlan(
        **{
            **entry,
            "row_groups": tuple(plan.row_groups),
            "block_offsets": tuple(plan.block_offsets),
        }
    )


def save_plan(folder: Path, plan: ObjectPlan) -> None:
    """Records `plan` atomically (a reader sees the old entry or the new one, never a part)."""
    if plan.object_version is None:  # nothing to key it by: planned again on every open
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entry = {FORMAT_KEY: FORMAT, VERSION_KEY: VERSION, **asdict(plan)}
    data = json.dumps(entry, sort_keys=True).encode("utf-8")
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    os.close(fd)
    try:
        write_synced(Path(temp), data)
        os.replace(temp, entry_path(folder, plan.url))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
