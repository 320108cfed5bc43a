"""The cache-file protocol every cache shares: versioned headers, sizes, atomic writes, lazy maps.

Use when: a dataset over many files is read by forked DataLoader workers, or a `build_*` step
writes a cache that workers, other ranks or a rerun after a crash will read.
- The cache-file protocol: a cache is a folder `header.json` + data files. The header names the
  format, its version and a fingerprint of the inputs; each data file's size follows from the
  header (`read_header`, `check_size`), so a truncated, stale or foreign cache is never served.
  `LazyMap` opens a data file's memory map once per process, on first use, and pickles as its
  path; a file truncated or replaced since the cache was opened raises the cache's error, not
  numpy's. Building the folder is `cache_builds.py`'s (`FolderBuild`); the DataLoader of a
  build pass is `common/loading/build_loader.py`.
Cost: one fsync per file and per folder; one JSON read and a `stat` per data file on open.
Adapt here: nothing; each cache passes its own format name, error type and rebuild hint.
Trade-off: sizes catch truncation and the header's own checksum a damaged header (reported as
damaged, not as stale); bit flips inside data files need `common/caches/cache_checks.py` (per-item
checksums). A build across nodes needs no shared file system (`cache_builds.py`).
Copy with: common/workers/held_descriptors.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from recipes.common.workers.held_descriptors import open_held, release


# ---- crash-safe writes --------------------------------------------------------------------
def write_synced(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and fsyncs it (the caller renames it into place)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """Makes a file's data durable, or for a folder, the renames inside it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def folder_lock(folder: Path):
    """An exclusive `flock` on the folder itself (no lock file left beside the caches), held
    by this thread: the check-and-swap of a publish, against other publishers of the folder.
    Fork-safe (`open_held`): a child forked meanwhile does not keep it held."""
    fd, token = open_held(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        release(fd, token)  # closing the descriptor drops the flock


def _host() -> str:
    return socket.gethostname().replace(".", "-") or "host"


def replace_dir(new: Path, target: Path, *, keep: Callable[[], bool] | None = None) -> bool:
    """Moves the complete folder `new` to `target`, unless `target` exists and `keep()` says
    it is a valid copy already (another process built the same cache meanwhile): then `new`
    is deleted and the first one stays, so a process reading it (or adding an eval view to
    it) never has it moved away. An invalid `target` is moved aside and deleted after, so a
    reader sees the old folder, none, or the new one, never a mix. The check and the swap
    happen under `folder_lock(target.parent)`: two publishers never both see the old folder
    invalid and then swap each other's valid one away. True when `new` was published."""
    fsync_path(new)
    old = None
    with folder_lock(target.parent):
        try:
            os.rename(new, target)  # atomic; fails when `target` is a folder with files in it
            published = True
        except OSError as why:
            if why.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            published = keep is None or not keep()
            if published:
                old = Path(
                    tempfile.mkdtemp(
                        prefix=f".{target.name}.{_host()}.{os.getpid()}.",
                        suffix=".old.tmp",
                        dir=target.parent,
                    )
                )  # swept like a temp if this process dies
                os.replace(target, old)  # onto an empty folder: allowed
                os.rename(new, target)
        fsync_path(target.parent)
    if not published:
        shutil.rmtree(new, ignore_errors=True)
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return published


# ---- the cache-file protocol ------------------------------------------------------------
def read_header(
    folder: Path,
    *,
    fmt: str,
    version: int,
    fingerprint: str | None,
    error: type[Exception],
    build_hint: str,
    fields: tuple[str, ...],
) -> dict:
    """`folder/header.json`, checked for format, version, fingerprint and `fields`.

    Raises:
        error: missing; damaged (not a JSON object, or a checksum that differs from its
            content: "damaged"); another format or version, another fingerprint ("built from
            other inputs"), or missing fields; the message says how to rebuild.
    """
    try:
        text = (Path(folder) / "header.json").read_bytes()
    except OSError as why:
        raise error(f"No readable cache at {folder} ({why}); build it with {build_hint}.") from None
    # a header whose checksum differs, or lacks one at the current version, is damaged, not stale
    try:
        header = json.loads(text)
        seal = header.pop("header_sha256", None) if isinstance(header, dict) else None
        damaged = not isinstance(header, dict) or (
            seal != _seal(header) and (seal or header.get("version") == version)
        )
    except (UnicodeDecodeError, json.JSONDecodeError):
        damaged = True
    if damaged:
        raise error(
            f"{folder}/header.json is damaged (not a JSON object, or its checksum differs from its "
            f"content); rebuild the cache with {build_hint}."
        )
    if not set(fields) <= set(header):
        raise error(
            f"{folder}/header.json is not a complete cache header; rebuild it with {build_hint}."
        )
    if header.get("format") != fmt or header.get("version") != version:
        raise error(
            f"{folder} holds format {header.get('format')} v{header.get('version')}, expected "
            f"{fmt} v{version}; rebuild it with {build_hint}."
        )
    if fingerprint is not None and header.get("fingerprint") != fingerprint:
        raise error(
            f"{folder} was built from other inputs or settings; rebuild it with {build_hint}."
        )
    return header


def _seal(header: dict) -> str:
    """The checksum `publish` adds to a header (`header_sha256`): of its other fields."""
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode("utf-8")).hexdigest()


def check_size(path: Path, expected: int, error: type[Exception]) -> None:
    """Raises `error` unless `path` exists with exactly `expected` bytes."""
    try:
        size = path.stat().st_size
    except OSError:
        raise error(f"{path} is missing; rebuild the cache.") from None
    if size != expected:
        raise error(
            f"{path} is {size} bytes, expected {expected} (truncated or corrupt); rebuild the "
            "cache."
        )


class CacheFileError(ValueError):
    """A cache data file that changed after its cache was opened (`LazyMap`'s default error)."""


class FileIdentity(NamedTuple):
    """Which file a path named when a cache opened it: a rebuild renamed into place changes the
    inode; a rewrite in place, the modification time."""

    inode: int
    mtime_ns: int


class LazyMap:
    """One data file of a cache, memory-mapped in each process on first use.

    A forked DataLoader worker must not use its parent's map (nor its file descriptor), and a
    spawned one cannot receive it: this object pickles as its path and reopens per process.
    Each process checks the file when it maps it (and `read_into` when it opens it): the size
    that `shape` says, and the file found at construction (inode and mtime, one `stat`).

    A file changed after the cache was opened (never by the protocol above, which builds in a
    temp folder and renames it into place), two cases:
    - replaced (a rebuild renamed a new folder into place): a process that mapped the file
      already keeps reading the old inode, whole until it unmaps it, consistent with the
      offsets it read. A process mapping it later (a worker started after the rebuild) would
      find another file under the path: it raises `error` rather than mix the new data with
      the old header's offsets.
    - truncated or rewritten in place (a cleanup, a rebuild into the live folder): a process
      mapping it later raises `error`, and so does a short read in `read_into`. A process
      that mapped it before the truncation gets SIGBUS from the kernel when it touches a page
      past the new end: a memory map cannot report that as an exception.

    Args:
        path: the data file.
        dtype, shape: what it holds (little-endian dtypes, as the caches write them).
        mode: "r", or "c" (copy-on-write: writable views for `torch.from_numpy`; the file is
            never written).
        error: the exception type raised for a changed file; pass the cache's own
            (`TokenCacheError`, ...).

    Raises:
        error: from `array` or `read_into`: the file changed as above; the message names it,
            its expected and actual size, and the fix (reopen the cache, or rebuild it).
    """

    def __init__(
        self,
        path: Path,
        dtype,
        shape: tuple[int, ...],
        *,
        mode: str = "r",
        error: type[Exception] = CacheFileError,
    ):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.mode = mode
        self.error = error
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        try:
            st = os.stat(self.path)
            self._identity: FileIdentity | None = FileIdentity(st.st_ino, st.st_mtime_ns)
        except OSError:  # not there yet: the size check alone
            self._identity = None
        self._pid: int | None = None
        self._array: np.ndarray | None = None
        self._fd: int | None = None

    @property
    def array(self) -> np.ndarray:
        if self._pid != os.getpid():
            self._array = self._map() if self.nbytes else np.zeros(self.shape, self.dtype)
            self._fd = None
            self._pid = os.getpid()
        return self._array

    def _map(self) -> np.ndarray:
        fd = self._open_checked()
        try:  # map the descriptor just checked, not the path again (it may be replaced meanwhile)
            with open(fd, "rb", closefd=False) as f:
                return np.memmap(f, dtype=self.dtype, mode=self.mode, shape=self.shape)
        finally:
            os.close(fd)  # the map holds its own

    def _open_checked(self) -> int:
        """A read-only descriptor of the file, checked against the cache opened over it."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self.error(
                f"{self.path} was removed after the cache was opened; rebuild the cache."
            ) from None
        st = os.fstat(fd)
        how = None
        if self._identity is not None and st.st_ino != self._identity.inode:
            how = "replaced by another file (a rebuild renamed a new cache into place)"
        elif st.st_size != self.nbytes or (
            self._identity is not None and st.st_mtime_ns != self._identity.mtime_ns
        ):
            how = "truncated in place" if st.st_size < self.nbytes else "rewritten in place"
        if how is not None:
            os.close(fd)
            raise self._changed(how, st.st_size)
        return fd

    def _changed(self, how: str, size: int) -> Exception:
        return self.error(
            f"{self.path} changed after the cache was opened: {how}; it is {size:,} bytes, "
            f"expected {self.nbytes:,}. Reopen the cache (its `open()` checks the folder again), "
            "or rebuild it if that fails."
        )

    def read_into(self, out, offset: int):
        """Copies bytes from byte `offset` into `out` (a C-contiguous array, or a list of them
        filled in turn) with one `preadv`: a kernel copy from the page cache, no page faults
        in a fresh worker. Returns `out`.

        Raises:
            error: the file changed after the cache was opened (a short read included)."""
        self.array  # noqa: B018 (the per-process reopen)
        if self._fd is None:
            self._fd = self._open_checked()
        buffers = out if isinstance(out, list) else [out]
        wanted = sum(b.nbytes for b in buffers)
        done = 0
        while done < wanted:  # at most IOV_MAX buffers per call
            chunk = buffers[:_IOV_MAX]
            got = os.preadv(self._fd, chunk, offset + done)
            if got != sum(b.nbytes for b in chunk):  # never hand out a half-filled buffer
                size = os.fstat(self._fd).st_size
                if size >= self.nbytes:
                    raise ValueError(
                        f"A read of {wanted:,} bytes at byte {offset:,} runs past the end of "
                        f"{self.path} ({self.nbytes:,} bytes)."
                    )
                raise self._changed(
                    f"truncated in place (a short read at byte {offset + done + got:,})", size
                )
            done = done + got
            buffers = buffers[_IOV_MAX:]
        return out

    def __getstate__(self):
        return {**self.__dict__, "_pid": None, "_array": None, "_fd": None}


_IOV_MAX = 1024
