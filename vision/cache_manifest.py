"""Which files a decoded-image cache was built from, so a stale one is named, not silently ignored.

Use when: an `ImageFolderFast(cache_dir=...)` tree changes after its cache was built. The
cache's name carries the fingerprint of its inputs, so a changed tree finds no cache under
its new name; without this, it decodes from files ~10x slower without a word, and the old
cache (250 GB at ImageNet scale) stays on disk for good.
Cost: a sidecar `.files.npy` of 24 bytes per image (path hash, size, mtime) written with the
cache; comparing it costs nothing beyond the stats the fingerprint already takes.
Adapt here: `MAX_NAMED` (how many changed files a warning names).
Trade-off: removed files are counted, not named (their paths are not stored).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

import numpy as np

from recipes.common.atomic import fsync_dir

MAX_NAMED = 5
_FILES = np.dtype([("path", "<i8"), ("size", "<i8"), ("mtime", "<i8")])


def file_table(rel_paths: list[str], sizes: list[int], mtimes: list[int]) -> np.ndarray:
    """One row per input file: a hash of its relative path, its size and mtime (ns)."""
    table = np.empty(len(rel_paths), _FILES)
    table["path"] = [_path_hash(p) for p in rel_paths]
    table["size"], table["mtime"] = sizes, mtimes
    return table


def sidecar(cache_path: Path) -> Path:
    return cache_path.with_name(cache_path.name.removesuffix(".bin") + ".files.npy")


def write_sidecar(cache_path: Path, table: np.ndarray) -> None:
    """Writes the file table next to `cache_path` (temp file, fsync, rename; no pickle)."""
    target = sidecar(cache_path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # swept like the cache's
    with open(tmp, "wb") as f:
        np.save(f, table, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)


def stale_caches(cache_dir: Path, root: str, fingerprint: str) -> list[Path]:
    """Caches in `cache_dir` built from this `root` but from other inputs (other fingerprint)."""
    from recipes.vision.image_cache import HEADER_BYTES, MAGIC

    found = []
    for path in sorted(Path(cache_dir).glob("images-*.bin")):
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES)
            header = json.loads(raw[len(MAGIC):].decode("utf-8")) if raw.startswith(MAGIC) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(header, dict) and header.get("root") == root and header.get("fingerprint") != fingerprint:
            found.append(path)
    return found


def remove_cache(path: Path) -> None:
    for p in (path, sidecar(path)):
        p.unlink(missing_ok=True)


def describe_change(old_cache: Path, rel_paths: list[str], table: np.ndarray) -> str:
    """What differs between the files `old_cache` was built from and the current ones."""
    try:
        old = np.load(sidecar(old_cache), allow_pickle=False)
    except (OSError, ValueError):
        return f"{old_cache.name} was built from other inputs (no file list to compare)"
    before = {int(h): (int(s), int(m)) for h, s, m in zip(old["path"], old["size"], old["mtime"], strict=True)}
    added, changed = [], []
    for rel, (h, s, m) in zip(rel_paths, table.tolist(), strict=True):
        if h not in before:
            added.append(rel)
        elif before.pop(h) != (s, m):
            changed.append(rel)
    parts = [f"{len(old):,} files when built, {len(table):,} now"]
    for label, names in (("added", added), ("changed (size or mtime)", changed)):
        if names:
            shown = ", ".join(names[:MAX_NAMED]) + (", ..." if len(names) > MAX_NAMED else "")
            parts.append(f"{len(names):,} {label}: {shown}")
    if before:
        parts.append(f"{len(before):,} removed")
    if len(parts) == 1:
        parts.append("the same files, but other labels or decode settings")
    return f"{old_cache.name}: " + "; ".join(parts)


def _path_hash(rel: str) -> int:
    digest = hashlib.blake2b(rel.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
