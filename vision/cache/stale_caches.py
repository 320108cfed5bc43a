"""Which files a decoded-image cache was built from, to name what changed in a stale one.

Use when: fingerprinting a dataset's files (`stat_files`, one `stat` each), and when a dataset
finds no cache for its current inputs but one built from the same root:
instead of a silent fall back to decoding (about 10x slower), the warning names the files
added or changed (size or mtime) since, and counts those removed. `build_image_cache` removes
such caches once the new one is built (and the older single-file format, version 1).
Cost: at build, one row per input file in `files.npy` (a hash of its relative path, its size
and mtime: 24 bytes); when no cache matches, one header read per `images-*` entry of
`cache_dir` and one load of a stale cache's `files.npy`.
Adapt here: `_MAX_NAMED`, how many file names a message lists.
Trade-off: paths are stored as 8-byte hashes, so a removed file is counted, not named.
Copy with: nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_MAX_NAMED = 5
_FILES = np.dtype([("path", "<i8"), ("size", "<i8"), ("mtime", "<i8")])
_LEGACY_MAGIC = b"RCPIMG01"  # format 1: one file `images-<fp>.bin` with a 4 KiB header


def stat_files(
    paths, targets: np.ndarray, root: str, settings: str
) -> tuple[str, list[str], np.ndarray]:
    """`(fingerprint, relative paths, file table)` of a dataset's files: one `stat` per file.
    The fingerprint is the sha256 of `settings` and the relative paths, sizes, mtimes and targets.
    """
    import hashlib
    import os

    digest = hashlib.sha256(settings.encode())
    rels = []
    sizes = []
    mtimes = []
    for path, target in zip(paths, targets.tolist(), strict=True):
        st = os.stat(path)
        rel = os.path.relpath(path, root)
        digest.update(
            f"\n{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{target}".encode("utf-8", "surrogateescape")
        )
        rels.append(rel)
        sizes.append(st.st_size)
        mtimes.append(st.st_mtime_ns)
    return digest.hexdigest(), rels, make_file_table(rels, sizes, mtimes)


def make_file_table(rel_paths: list[str], sizes: list[int], mtimes: list[int]) -> np.ndarray:
    """One row per input file: a hash of its relative path, its size and mtime (ns)."""
    import hashlib

    table = np.empty(len(rel_paths), _FILES)
    table["path"] = [
        int.from_bytes(
            hashlib.blake2b(p.encode("utf-8", "surrogateescape"), digest_size=8).digest(),
            "little",
            signed=True,
        )
        for p in rel_paths
    ]
    table["size"] = sizes
    table["mtime"] = mtimes
    return table


def find_stale_caches(cache_dir: Path, root: str, fingerprint: str) -> list[Path]:
    """Caches in `cache_dir` built from this `root` but from other inputs (or an older format)."""
    import json

    found = []
    for path in sorted(Path(cache_dir).glob("images-*")):
        try:
            if path.is_dir():
                header = json.loads((path / "header.json").read_text())
            elif path.suffix == ".bin":
                with open(path, "rb") as f:
                    raw = f.read(4096)
                header = {}
                if raw.startswith(_LEGACY_MAGIC):
                    header = json.loads(raw[len(_LEGACY_MAGIC) :].decode("utf-8"))
            else:
                continue
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if (
            isinstance(header, dict)
            and header.get("root") == root
            and (header.get("fingerprint") != fingerprint or not path.is_dir())
        ):
            found.append(path)
    return found


def _sidecar(cache: Path) -> Path:
    if cache.is_dir():
        return cache / "files.npy"
    return cache.with_name(cache.name.removesuffix(".bin") + ".files.npy")


def remove_cache(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        for p in (path, _sidecar(path)):
            p.unlink(missing_ok=True)


def describe_change(old_cache: Path, rel_paths: list[str], table: np.ndarray) -> str:
    """What differs between the files `old_cache` was built from and the current ones."""
    try:
        old = np.load(_sidecar(old_cache), allow_pickle=False)
    except (OSError, ValueError):
        return f"{old_cache.name} was built from other inputs (no file list to compare)"
    before = {
        int(h): (int(s), int(m))
        for h, s, m in zip(old["path"], old["size"], old["mtime"], strict=True)
    }
    added = []
    changed = []
    for rel, (h, s, m) in zip(rel_paths, table.tolist(), strict=True):
        if h not in before:
            added.append(rel)
        elif before.pop(h) != (s, m):
            changed.append(rel)
    parts = [f"{len(old):,} files when built, {len(table):,} now"]
    for label, names in (("added", added), ("changed (size or mtime)", changed)):
        if names:
            shown = ", ".join(names[:_MAX_NAMED]) + (", ..." if len(names) > _MAX_NAMED else "")
            parts.append(f"{len(names):,} {label}: {shown}")
    if before:
        parts.append(f"{len(before):,} removed")
    if len(parts) == 1:
        parts.append("the same files, but other labels, decode settings or an older cache format")
    return f"{old_cache.name}: " + "; ".join(parts)
