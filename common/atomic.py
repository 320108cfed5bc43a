"""Crash-safe writes: temp file or folder, fsync, rename into place.

Use when: writing a cache that other processes (workers, ranks, a rerun after a crash) may
read. A reader sees the old version, nothing, or the new version; never a partial file.
Cost: one fsync per file and one per folder.
Adapt here: nothing; this is the mechanism every recipe cache uses.
Trade-off: needs the temp file on the same filesystem as the target (rename is atomic only
within one filesystem), so temps live next to their target.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and fsyncs it (the caller renames it into place)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    """Makes a rename inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(new: Path, target: Path) -> None:
    """Moves the complete folder `new` to `target`. An old `target` is moved aside first and
    deleted after, so a reader sees the old folder, none, or the new one, never a mix."""
    fsync_dir(new)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
