"""One remote object, streamed front to back into an open file, and a check of what arrived.

Use when: a download must land in a file the caller opened (a temp file it will verify, sync
and rename, through a descriptor it controls: fsspec's `get_file` opens its own, which a
forked child would inherit), and a body cut short or a wrong checksum must never pass.
Cost: one request (one streamed GET over http(s)); reads of `_BLOCK` bytes; a full read of
the file again when a sha256 is given.
Adapt here: `_BLOCK`; `_open_stream` for a filesystem whose files read ahead.
Trade-off: one connection per object; common/remote/ranged_download.py splits a large object into
concurrent ranges where a store caps each connection.
Copy with: common/caches/cache_folder.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import recipes.common.caches.cache_folder as cache_folder

_BLOCK = 4 * 2**20  # bytes per read


class ShortBody(OSError):
    """Fewer bytes arrived than the server announced (a connection cut short): transient."""


class ChecksumMismatch(OSError):
    """The bytes that arrived do not have the expected sha256."""


def _nothing() -> None:
    pass


def download_whole(
    fs, remote: str, fd: int, size: int | None, *, check: Callable[[], None] = _nothing
) -> None:
    """`remote` on the fsspec filesystem `fs` into the file `fd` from byte 0 (what it held is
    dropped); `check` is called after each block read (raise from it to stop early)."""
    os.ftruncate(fd, 0)  # what an earlier attempt (e.g. a ranged one) wrote
    offset = 0
    with _open_stream(fs, remote, size) as source:
        while block := source.read(_BLOCK):
            check()
            pwrite_all(fd, block, offset)
            offset += len(block)


def _open_stream(fs, remote: str, size: int | None):
    """`remote` opened for one front-to-back read: over http(s) one streamed GET (fsspec's
    random-access HTTP file would send ranged GETs, which a server may not support);
    elsewhere the filesystem's own file, each `_BLOCK` read one request (no read-ahead)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"http", "https"} & set(protocols):
        return fs.open(remote, "rb", block_size=0, size=size)
    return fs.open(remote, "rb", block_size=_BLOCK, cache_type="none")


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset`: a write may stop short (a nearly full disk writes what fits
    before it fails), and a short write ignored would leave a hole of zeros in the file."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"a write at byte {offset:,} of a download wrote nothing")
        view = view[written:]
        offset = offset + written


def verify_download(url: str, fd: int, size: int | None, sha256: str | None) -> None:
    """Raises `ShortBody` if the file `fd` is not `size` bytes long, `ChecksumMismatch` if its
    sha256 differs from `sha256` (each check skipped when None); `url` is named in the error."""
    actual = os.fstat(fd).st_size
    if size is not None and actual != size:
        raise ShortBody(f"{url}: got {actual:,} of {size:,} bytes")
    if sha256 is not None:
        digest = _sha256_of(fd)
        if digest != sha256:
            raise ChecksumMismatch(f"{url}: sha256 {digest} differs from the expected {sha256}")


_HASHED: dict[tuple, str] = {}  # (path, inode, size, mtime_ns, ctime_ns) -> sha256, this process's


def file_sha256(path: str | os.PathLike, info: os.stat_result) -> str:
    """The sha256 of the file at `path` that `info` (its `os.stat`) describes, hashed once per
    process and file version: a write, a replace or a change of its times (the ctime, which
    nobody can set back) makes another version."""
    key = (os.fspath(path), info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _HASHED:
        fd = os.open(path, os.O_RDONLY)
        try:
            _HASHED[key] = _sha256_of(fd)
        finally:
            os.close(fd)
    return _HASHED[key]


def _sha256_of(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, 1 << 20, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def matches_sum(path: Path, sha256: str) -> bool:
    """Whether the file at `path` has this sha256: the checksum recorded beside it when the
    record still describes it (`cache_folder.record_sum`: its inode, size, mtime and ctime),
    else hashed (`file_sha256`: once per process and file version) and recorded for every
    other process."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return True  # gone meanwhile: the caller downloads it
    recorded = cache_folder.recorded_sum(path, info)
    if recorded is not None:
        return recorded == sha256
    digest = file_sha256(path, info)
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ctime_ns == info.st_ctime_ns:  # unchanged while it was hashed
            cache_folder.record_sum(path, digest, info)
    return digest == sha256
