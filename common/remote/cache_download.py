"""One remote object downloaded into a cache folder: the size checked against the budget, room
reserved, the bytes transferred (whole, or as concurrent ranges), verified, synced and renamed
into place; retried while the errors are transient, and a `DownloadError` when they outlast the
retries.

Use when: you read what one `PrefetchCache.get` miss does (`CacheTransfer.download`), or
change how an object reaches the cache (ranges, verification, the errors it raises).
Cost: one reservation (an flock and, when the folder is full, an eviction scan); the transfer;
a full read of the file again when a sha256 is given; one fsync of the file and one of the
folder.
Adapt here: `CacheTransfer._transfer` (when an object is fetched as ranges).
Trade-off: a checksum that differs twice is not retried again: the second mismatch means the
object is damaged where it is stored (or rewritten since it was indexed), not on the wire.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py,
  common/remote/object_download.py, common/remote/ranged_download.py, common/remote/retries.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import recipes.common.caches.cache_folder as cache_folder
from recipes.common.caches.cache_files import fsync_path
from recipes.common.remote.object_download import ChecksumMismatch, download_whole, verify_download
from recipes.common.remote.ranged_download import ConcurrencySearch, NoRangeSupport, download_ranges
from recipes.common.remote.retries import call_with_retries
from recipes.common.workers.held_descriptors import release


class DownloadError(OSError):
    """A download that failed after every retry; names the URL, the attempts and the last error."""


class Controls(NamedTuple):
    """What a download asks its cache as it goes: `check()` raises once the cache is closed;
    `pause(seconds)` waits, or raises as soon as it closes; `search()` is the cache's shared
    search of the ranges of one object in flight."""

    check: Callable[[], None]
    pause: Callable[[float], None]
    search: Callable[[], ConcurrencySearch]


class Source(NamedTuple):
    """Where an object is read from: its fsspec filesystem, its path there, and its URL (named
    in errors)."""

    fs: object
    remote: str
    url: str


@dataclass(frozen=True)
class CacheTransfer:
    """How a cache downloads: its folder and budget (`max_bytes`), objects larger than
    `range_bytes` as ranges (`range_connections` in flight at first), and the retries."""

    folder: Path
    max_bytes: int
    range_bytes: int
    range_connections: int
    retries: int
    backoff: float

    def download(self, source: Source, final: Path, sha256: str | None, controls: Controls) -> None:
        """`source` into `final`, verified against `sha256` when given; retried while the errors
        are transient.

        Raises:
            DownloadError: the errors outlasted the retries, or the checksum differed twice.
        """
        mismatches = []

        def attempt() -> None:
            try:
                self._attempt(source, final, sha256, controls)
            except ChecksumMismatch as error:
                # once: bytes damaged on the wire, worth another download; twice: the stored
                # object is damaged (or not the one indexed), and backing off will not mend it
                mismatches.append(error)
                if len(mismatches) < 2:
                    raise
                failure = DownloadError(
                    f"{error}, on two downloads: the object is damaged where it is stored, or "
                    "was rewritten since its checksum was recorded (not damage in transit); "
                    "rewrite it, or re-index it."
                )
                failure.transient = False
                raise failure from error

        def give_up(attempts: int, last: BaseException) -> DownloadError:
            return DownloadError(
                f"{source.url}: failed after {attempts} attempts; last error: "
                f"{type(last).__name__}: {last}"
            )

        call_with_retries(
            attempt,
            retries=self.retries,
            backoff=self.backoff,
            sleep=controls.pause,
            final=give_up,
        )

    def _attempt(self, source: Source, final: Path, sha256: str | None, controls: Controls) -> None:
        """One try: size check, reservation, transfer, verification, rename; an error removes
        the temp file."""
        reserved = None
        try:
            size = source.fs.info(source.remote).get("size")
            if size is not None and size > self.max_bytes:
                raise ValueError(
                    f"{source.url} is {size:,} bytes, over the cache's "
                    f"max_bytes={self.max_bytes:,}; raise max_bytes or read it without the cache."
                )
            reserved = cache_folder.reserve(
                self.folder, final.name, size or 0, max_bytes=self.max_bytes, pause=controls.pause
            )
            if reserved is None:
                raise DownloadError(
                    f"no room for {size or 0:,} bytes in {self.folder}: the files in use fill "
                    f"max_bytes={self.max_bytes:,}; raise max_bytes or read fewer shards at once."
                )
            fd = (
                reserved.fd
            )  # the temp file's only descriptor: written, verified, synced through it
            self._transfer(source, fd, size, controls)
            verify_download(source.url, fd, size, sha256)
            os.fsync(fd)
            os.replace(reserved.path, final)
            fsync_path(self.folder)
            cache_folder.touch(final)  # used now: its download just finished
            if sha256 is not None:
                cache_folder.record_sum(final, sha256)
        except BaseException:
            if reserved is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(reserved.path)
            raise
        finally:
            if reserved is not None:
                release(reserved.fd, reserved.token)

    def _transfer(self, source: Source, fd: int, size: int | None, controls: Controls) -> None:
        """The bytes into `fd`: as concurrent ranges when the object is large, else (or when the
        server ignores Range) one whole-object GET."""
        if size is None or size <= self.range_bytes or self.range_connections <= 1:
            download_whole(source.fs, source.remote, fd, size, check=controls.check)
            return
        try:
            download_ranges(
                source.fs,
                source.remote,
                source.url,
                fd,
                size,
                range_bytes=self.range_bytes,
                search=controls.search(),
                retries=self.retries,
                backoff=self.backoff,
                check=controls.check,
                sleep=controls.pause,
            )
        except NoRangeSupport:  # the server ignores Range: one whole-object GET
            download_whole(source.fs, source.remote, fd, size, check=controls.check)
