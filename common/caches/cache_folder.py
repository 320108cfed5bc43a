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
Trade-off: LRU by last use (`touch` marks it on the key's lock file), not by access counts; the
budget counts reservations of writes in flight, so a big write waits for room rather than overshoot.
Copy with: common/workers/held_descriptors.py, common/workers/process_lifetime.py."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from recipes.common.workers.held_descriptors import open_held, release
from recipes.common.workers.process_lifetime import pid_alive

_TEMP = re.compile(r"^\.tmp\.(\d+)\.[0-9a-f]+\.(\d+)\.[0-9a-f]+$")


def make_folder(folder: Path) -> None:
    """Creates `folder` and its `.locks/`, private to this user (mode 0o700)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    (folder / ".locks").mkdir(exist_ok=True, mode=0o700)


def touch(path: Path) -> bool:
    """Marks `path` as just used and says whether it exists. The use is recorded on its key's
    lock file (`.locks/<name>.lock`, its modification time), never on the file itself: the
    file's own times (its ctime above all) then change only when its content does, which is
    what a record of its checksum (`record_sum`) relies on."""
    if not path.exists():
        return False
    lock = path.parent / ".locks" / f"{path.name}.lock"
    now = (
        time.time_ns()
    )  # set explicitly: the kernel's own stamp is coarse (jiffies), uses ms apart would tie
    try:
        os.utime(lock, ns=(now, now))
    except FileNotFoundError:
        os.close(os.open(lock, os.O_WRONLY | os.O_CREAT, 0o600))
        os.utime(lock, ns=(now, now))
    return True


def last_use(folder: Path, name: str, file_mtime_ns: int) -> int:
    """When the file `name` was last used (`touch`), in ns; its own mtime if never touched."""
    try:
        return os.stat(folder / ".locks" / f"{name}.lock").st_mtime_ns
    except FileNotFoundError:
        return file_mtime_ns


# ---- checksums recorded beside the files ----------------------------------------------------
# `.locks/<name>.sum` holds "<inode>:<size>:<mtime_ns>:<ctime_ns>:<sha256>" of the file `name`
# as it was when hashed. The kernel moves a file's ctime on every write and every change of its
# metadata (`utime` included), and nobody can set it back: a record that matches the file's
# inode, size, mtime and ctime describes its content now.
def _identity(info: os.stat_result) -> str:
    return f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}:"


def record_sum(path: Path, sha256: str, info: os.stat_result | None = None) -> None:
    """Records `sha256` as the checksum of `path` as it is now (or as `info` found it),
    atomically."""
    info = info or os.stat(path)
    record = path.parent / ".locks" / f"{path.name}.sum"
    temp = record.with_name(f"{record.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        temp.write_text(_identity(info) + sha256)
        os.replace(temp, record)
    finally:
        temp.unlink(missing_ok=True)


def recorded_sum(path: Path, info: os.stat_result) -> str | None:
    """The checksum recorded for `path` if the record describes the file `info` found, else None."""
    try:
        text = (path.parent / ".locks" / f"{path.name}.sum").read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    identity = _identity(info)
    return text[len(identity) :] if text.startswith(identity) else None


@contextlib.contextmanager
def key_lock(
    folder: Path,
    name: str,
    mode: int,
    *,
    pause: Callable[[float], None] | None = None,
    unless: Callable[[], bool] | None = None,
):
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


class Reservation(NamedTuple):
    """A temp file whose name reserves room in a cache folder: its path, and the fork-safe
    descriptor it is open through (`release(fd, token)` closes it)."""

    path: Path
    fd: int
    token: object


def reserve(
    folder: Path,
    key: str,
    size: int,
    *,
    max_bytes: int,
    timeout: float = 60,
    pause: Callable[[float], None] = time.sleep,
) -> Reservation | None:
    """Frees room for `size` bytes (LRU, skipping locked files) and creates the temp file whose
    name carries the reservation, under one folder-wide lock, retrying every 0.2 s.

    Returns:
        A `Reservation`: the temp file, open for reading and writing through a fork-safe
        descriptor (`release(fd, token)` closes it); None if no room freed up in `timeout` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        with key_lock(folder, "evict", fcntl.LOCK_EX):
            if evict_until(folder, max_bytes - size):
                tmp = folder / f".tmp.{os.getpid()}.{secrets.token_hex(4)}.{size}.{key}"
                fd, token = open_held(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                return Reservation(tmp, fd, token)
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

    def last_used(entry) -> int:
        return last_use(folder, entry.name, entry.stat().st_mtime_ns)

    for entry in sorted(files, key=last_used):  # least recently used first
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
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / ".locks" / f"{entry.name}.sum")
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
