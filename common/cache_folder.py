"""A size-bounded folder of files shared by processes: per-key flocks, reservations, LRU eviction.

Use when: several processes (DataLoader workers, ranks on a node) fill one local folder with
files that must never be seen half-written, under a byte budget, and a file being read must
not be evicted. Files are written to a temp name that carries the writer's pid and the bytes
it reserved (`.tmp.<pid>.<nonce>.<size>.<key>`), then renamed; each key has its own lock file
under `.locks/` (an exclusive flock while a file is written, a shared one while it is read);
`reserve` frees room, least recently used first, skipping locked files, under one folder-wide
lock; `sweep` removes temp files whose writer died.
Cost: a directory scan per reservation that must free space, and per `used_bytes`; an open and
an flock per lock taken.
Adapt here: nothing; the caller chooses keys (e.g. hashes of URLs) and the budget.
Trade-off: LRU by access time (`touch` marks a use), not by access counts; the budget
counts reservations of writes in flight, so a big write waits for room rather than overshoot.
Copy with: common/held_descriptors.py, common/process_lifetime.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from recipes.common.held_descriptors import open_held, release
from recipes.common.process_lifetime import pid_alive

_TEMP = re.compile(r"^\.tmp\.(\d+)\.[0-9a-f]+\.(\d+)\.[0-9a-f]+$")


def make_folder(folder: Path) -> None:
    """Creates `folder` and its `.locks/`, private to this user (mode 0o700)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    (folder / ".locks").mkdir(exist_ok=True, mode=0o700)


def touch(path: Path) -> bool:
    """Marks `path` as just used (LRU: its access time) and says whether it exists. The
    modification time stays the content's: a record of the file's checksum names it."""
    try:
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
        return True
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def key_lock(folder: Path, name: str, mode: int, *, pause: Callable[[float], None] | None = None,
             unless: Callable[[], bool] | None = None):
    """Holds the flock `mode` (`fcntl.LOCK_EX` or `LOCK_SH`) on key `name` of `folder`; yields
    True once held.

    A new open file description per call: threads of one process exclude each other too. The
    descriptor is fork-safe (`open_held`). With `pause`, the lock is polled (every 1 to 10 ms,
    sleeping through `pause`), so that the caller can end the wait by raising from `pause`; with
    `unless` too, the wait also ends when `unless()` turns true, and the context yields False
    (not held): a downloader waiting for a key whose file has appeared meanwhile must not wait
    on for the readers that now hold it shared (they may be waiting for the downloader's batch).
    """
    fd, token = open_held(folder / ".locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT)
    try:
        if pause is None:
            fcntl.flock(fd, mode)
        else:
            delay = 0.001
            while not _try_flock(fd, mode):
                if unless is not None and unless():
                    yield False
                    return
                pause(delay)
                delay = min(2 * delay, 0.01)
        yield True
    finally:
        release(fd, token)


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def reserve(folder: Path, key: str, size: int, *, max_bytes: int, timeout: float = 60,
            pause: Callable[[float], None] = time.sleep) -> tuple[Path, int, object] | None:
    """Frees room for `size` bytes (LRU, skipping locked files) and creates the temp file whose
    name carries the reservation, under one folder-wide lock, retrying every 0.2 s.

    Returns:
        `(path, fd, token)`: the temp file, open for reading and writing through a fork-safe
        descriptor (`release(fd, token)` closes it); None if no room freed up in `timeout` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        with key_lock(folder, "evict", fcntl.LOCK_EX):
            if evict_until(folder, max_bytes - size):
                tmp = folder / f".tmp.{os.getpid()}.{secrets.token_hex(4)}.{size}.{key}"
                return (tmp, *open_held(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL))
        if time.monotonic() > deadline:
            return None
        pause(0.2)


def evict_until(folder: Path, budget: int) -> bool:
    """Removes least recently used files that no one holds a lock on, until `used_bytes` is at
    most `budget`; says whether it got there."""
    used = used_bytes(folder)
    if used <= budget:
        return True
    files = [e for e in os.scandir(folder) if e.is_file() and not e.name.startswith(".")]
    for entry in sorted(files, key=lambda e: e.stat().st_atime_ns):  # least recently used first
        lock, token = open_held(folder / ".locks" / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not pinned, not downloading
        except BlockingIOError:
            release(lock, token)
            continue
        try:
            size = entry.stat().st_size
            os.unlink(entry.path)
            used -= size
        except FileNotFoundError:
            pass
        finally:
            release(lock, token)
        if used <= budget:
            return True
    return False


def used_bytes(folder: Path) -> int:
    """Bytes of complete files plus reservations of writes in flight."""
    total = 0
    for entry in os.scandir(folder):
        match = _TEMP.match(entry.name)
        if match:
            total += int(match.group(2))
        elif entry.is_file() and not entry.name.startswith("."):
            with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                total += entry.stat().st_size
    return total


def sweep(folder: Path) -> int:
    """Removes temp files whose writer process is gone; returns how many."""
    removed = 0
    for entry in os.scandir(folder):
        match = _TEMP.match(entry.name)
        if match and not pid_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed

