"""PrefetchCache: a crash-safe, size-bounded, process-shared local cache for remote objects.

Use when: training reads shards from object storage or HTTP and you want each shard
downloaded once per node (all workers and ranks share it), ahead of time, and never served
half-written. fsspec's `simplecache`/`filecache` write straight to the final path, so a crash
or a concurrent reader sees a partial file (fsspec#639: 69 of 80 concurrent reads corrupt).
Cost: one download per object per node; background threads (`prefetch` at a time) per process;
an flock per access; a directory scan when space must be freed.
Adapt here: `ALLOWED` (common/remote/object_urls.py); `is_transient` (common/remote/retries.py).
Trade-off: whole objects are cached (no partial reads of huge objects); LRU by access time.

How it holds up, each mechanism in its own file: the folder (common/caches/cache_folder.py:
temp file, fsync, rename; one flock per key, so one process downloads and the others wait;
`pinned(url)` holds a shared flock that LRU eviction respects; dead processes' temps swept);
the transfer (common/remote/object_download.py, ranged_download.py: sizes and an optional
sha256 checked; large objects as concurrent ranged GETs, adapted up to `max_connections`);
the URL policy (object_urls.py: `pipe:`, `a::b` and unknown protocols refused); retries
(retries.py: backoff with jitter; the error names the URL and attempts; a full disk raises at
once); fork (common/workers/held_descriptors.py: descriptors held by download threads are
closed in a forked child). `close()` (or `with`) stops this process's downloads and joins its
threads; later calls raise `CacheClosedError`.
Copy with: common/caches/cache_files.py, common/caches/cache_folder.py,
  common/remote/cache_download.py, common/remote/object_download.py, common/remote/object_urls.py,
  common/remote/process_downloads.py, common/remote/ranged_download.py, common/remote/retries.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import torch

import recipes.common.caches.cache_folder as cache_folder
from recipes.common.remote.cache_download import CacheTransfer, Controls, DownloadError, Source
from recipes.common.remote.object_download import matches_sum
from recipes.common.remote.object_urls import cache_key, check_url, open_filesystem
from recipes.common.remote.process_downloads import ProcessDownloads
from recipes.common.remote.ranged_download import ConcurrencySearch
from recipes.common.remote.retries import StopRetrying

__all__ = ["CacheClosedError", "DownloadError", "PrefetchCache"]


class CacheClosedError(StopRetrying, RuntimeError):
    """A call on a `PrefetchCache` after its `close()`; names the cache folder."""


class PrefetchCache:
    """Local copies of remote objects, downloaded once per node, ahead of use.

    Args:
        cache_dir: the cache folder (created with mode 0o700).
        max_bytes: the folder's budget; least recently used files are evicted to stay under it.
        prefetch: downloads running at once in background threads (and shards read ahead).
        retries: retries after the first attempt for transient errors.
        backoff: the first retry's delay in seconds; doubled each retry, with jitter.
        storage_options: passed to fsspec (e.g. `{"client_kwargs": {"endpoint_url": ...}}`).
        range_bytes: objects larger than this are fetched as ranges of this size.
        range_connections: ranges of one object in flight at first.
        max_connections: the most ranges of one object in flight once adapted
            (`range_connections` disables adapting).

    Raises:
        ValueError: invalid arguments.

    Example:
        >>> with PrefetchCache("/local/nvme/shards", max_bytes=200 * 2**30) as cache:
        ...     cache.prefetch(urls[1:5])
        ...     with cache.pinned(urls[0]) as path:
        ...         data = path.read_bytes()
    """

    def __init__(
        self,
        cache_dir,
        *,
        max_bytes: int,
        prefetch: int = 4,
        retries: int = 5,
        backoff: float = 0.5,
        storage_options: dict | None = None,
        range_bytes: int = 2 * 2**20,
        range_connections: int = 4,
        max_connections: int = 16,
    ):
        for name, value in (
            ("max_bytes", max_bytes),
            ("prefetch", prefetch),
            ("range_bytes", range_bytes),
            ("range_connections", range_connections),
            ("max_connections", max_connections),
        ):
            if value <= 0:
                raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
        if max_connections < range_connections:
            raise ValueError(
                f"`max_connections` ({max_connections}) must be at least `range_connections` "
                f"({range_connections})."
            )
        if retries < 0 or backoff < 0:
            raise ValueError(
                f"`retries` and `backoff` must be non-negative, but are {retries!r} and "
                f"{backoff!r}."
            )
        self.dir = Path(cache_dir)
        self.max_bytes = max_bytes
        self.depth = prefetch
        self.retries = retries
        self.backoff = backoff
        self.storage_options = dict(storage_options or {})
        self.range_bytes = range_bytes
        self.range_connections = range_connections
        self.max_connections = max_connections
        cache_folder.make_folder(self.dir)
        self._closed = False
        self._parts: dict[
            int, ProcessDownloads
        ] = {}  # by pid: a forked child never uses its parent's
        self._paths: dict[str, Path] = {}
        # hits, misses, bytes downloaded: shared memory, so forked and spawned DataLoader
        # workers add to the counts the main process reads (`stats()`, `LoaderMonitor`).
        self._counts = torch.zeros(3, dtype=torch.int64).share_memory_()
        # The adapted level (ranges of one object in flight) and the rest of its search, shared:
        # workers forked later start from what the main process (or an earlier worker) learned,
        # and all of them run one search (issue 19).
        self._level = torch.tensor([range_connections], dtype=torch.int64).share_memory_()
        self._search = ConcurrencySearch.new_search(self._level, max_connections)
        self._fs: dict = {}
        self._adapt: ConcurrencySearch | None = None
        self.sweep()

    # ---- public API --------------------------------------------------------------------
    def path_for(self, url: str) -> Path:
        """Where `url` is cached: a hash of the URL, inside the cache folder."""
        path = self._paths.get(url)
        if path is None:
            path = self._paths[url] = self.dir / cache_key(url)
        return path

    def get(self, url: str, *, sha256: str | None = None) -> Path:
        """A local, complete copy of `url`, downloading it first if needed. With `sha256`, the
        download is verified, and so is a copy already in the cache (once per process and file
        version): a copy that differs (the object was rewritten, or the file damaged) is removed and
        downloaded again.

        Raises:
            ValueError: a refused protocol, or an object larger than `max_bytes`.
            FileNotFoundError: the object does not exist.
            DownloadError: transient failures outlasted the retries.
            CacheClosedError: the cache is closed (also when `close()` ends this call early).
        """
        self._check_open()
        check_url(url)
        final = self.path_for(url)
        if sha256 is not None and final.exists() and not matches_sum(final, sha256):
            # a copy of another version of the object (rewritten under the same URL) or a damaged
            # one: never served; removed, and downloaded again below
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
        if cache_folder.touch(final):
            self._count(hits=1)
            return final
        with (
            self._part().running(self._check_open),
            cache_folder.key_lock(
                self.dir, final.name, fcntl.LOCK_EX, pause=self._pause, unless=final.exists
            ),
        ):
            if cache_folder.touch(final):  # another process or thread finished it while we waited
                # (a prefetch downloads unverified)
                if sha256 is None or matches_sum(final, sha256):
                    self._count(hits=1)
                    return final
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(final)
            self._download(url, final, sha256)
            # under the key's lock: once released, another process may evict it
            size = final.stat().st_size
        self._count(misses=1, downloaded=size)
        return final

    def connect(self, url: str) -> None:
        """Imports `url`'s filesystem and opens its client now (s3fs: ~0.3 s to import, ~0.1 s
        to connect in a fresh process), so that the first download does not wait for them:
        call it once at setup, e.g. before building the model. Optional: the first download
        does it otherwise."""
        self._check_open()
        check_url(url)
        fs, _ = self._filesystem(url)
        if hasattr(fs, "connect"):  # s3fs
            fs.connect()
        elif hasattr(fs, "set_session") and getattr(fs, "loop", None) is not None:  # http(s), gcsfs
            from fsspec.asyn import sync

            sync(fs.loop, fs.set_session)

    def stats(self) -> dict[str, int]:
        """`{"hits", "misses", "bytes_downloaded"}` of every `get` so far, in this process and
        the DataLoader workers that share this object (a miss is a download)."""
        hits, misses, downloaded = self._counts.tolist()
        return {"hits": hits, "misses": misses, "bytes_downloaded": downloaded}

    def concurrency(self) -> dict[str, int]:
        """`{"objects", "ranges_per_object"}`: downloads at once (`prefetch`) and the ranges
        of one object in flight, as adapted so far (the latest level any process chose)."""
        return {"objects": self.depth, "ranges_per_object": int(self._level.item())}

    def _count(self, *, hits: int = 0, misses: int = 0, downloaded: int = 0) -> None:
        # The shared tensor's `+=` is a read-modify-write: an flock makes it exact across the
        # threads and processes that share it (~10 us, against a shard read).
        with cache_folder.key_lock(self.dir, "stats", fcntl.LOCK_EX):
            self._counts += torch.tensor([hits, misses, downloaded])

    @contextlib.contextmanager
    def pinned(self, url: str, *, sha256: str | None = None):
        """`get(url)`, holding a shared lock so eviction leaves the file alone meanwhile."""
        for _ in range(5):
            path = self.get(url, sha256=sha256)
            with cache_folder.key_lock(self.dir, path.name, fcntl.LOCK_SH):
                if path.exists():
                    yield path
                    return
        raise DownloadError(
            f"{url}: evicted again and again before it could be read; raise max_bytes."
        )

    def prefetch(self, urls: Iterable[str]) -> list[Future]:
        """Starts background downloads (at most `prefetch` at once); errors surface on `get`
        (`CacheClosedError` here once closed)."""
        self._check_open()
        futures = []
        for url in urls:
            if os.path.exists(self.path_for(url)):
                continue
            # The filesystem (and its imports) is made here, in the caller's thread: a fork
            # (DataLoader workers) while a background thread is half-way through an import
            # could leave the child a held import lock. `connect()` opens the client too.
            self._filesystem(url)
            running = self._part().submit(
                url, self._quiet_get, threads=self.depth, check=self._check_open
            )
            futures.append(running)
        return futures

    def close(self) -> None:
        """Stops this process's downloads and joins its download threads; idempotent.

        Queued prefetches are cancelled (their futures raise `CancelledError`); running
        downloads, in the cache's threads or in callers' `get`, stop at their next block, range
        or retry wait and remove their temp file (one that already has every byte is renamed
        into place), and a `get` waiting for another process's download stops waiting. Once
        `close` returns, no download of this cache runs in this process and the lock and temp
        file descriptors they held are closed. `pinned` readers keep their file until their
        `with` ends. Later `get`, `pinned`, `prefetch` and `connect` raise `CacheClosedError`;
        `stats`, `path_for` and `used_bytes` still answer. In a forked DataLoader worker it
        closes the worker's copy: threads the parent started are the parent's, left alone.
        """
        self._closed = True  # before reading `_parts`: a `get` starting now sees it (`running`)
        part = self._parts.get(os.getpid())
        if part is None:  # this process never downloaded through this object
            return
        part.stop()
        self._fs = {k: v for k, v in self._fs.items() if k.pid != os.getpid()}

    def __enter__(self) -> PrefetchCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sweep(self) -> int:
        """Removes temp files whose writer process is gone; returns how many."""
        return cache_folder.sweep(self.dir)

    def used_bytes(self) -> int:
        """Bytes of complete files plus reservations of downloads in flight."""
        return cache_folder.used_bytes(self.dir)

    # ---- downloading -------------------------------------------------------------------
    def _download(self, url: str, final: Path, sha256: str | None) -> None:
        fs, remote = self._filesystem(url)
        transfer = CacheTransfer(
            self.dir,
            self.max_bytes,
            self.range_bytes,
            self.range_connections,
            self.retries,
            self.backoff,
        )
        controls = Controls(self._check_open, self._pause, self._adapter)
        transfer.download(Source(fs, remote, url), final, sha256, controls)

    def _filesystem(self, url: str):
        """(filesystem, path): one fsspec filesystem per process and protocol, reused."""
        self._fs = {k: v for k, v in self._fs.items() if k.pid == os.getpid()}  # drop a parent's
        return open_filesystem(
            url, self.storage_options, self.depth * self.max_connections, self._fs
        )

    def _adapter(self) -> ConcurrencySearch:
        if self._adapt is None:  # stateless but for the shared tensors: fine in a forked child too
            lock = functools.partial(
                cache_folder.key_lock, self.dir, "adapt", fcntl.LOCK_EX
            )  # excludes threads and processes
            self._adapt = ConcurrencySearch(
                self._level, self.max_connections, search=self._search, lock=lock
            )
        return self._adapt

    def _part(self) -> ProcessDownloads:
        part = self._parts.get(os.getpid())
        if part is None:  # first use in this process; `setdefault` is atomic: one part per process
            part = self._parts.setdefault(os.getpid(), ProcessDownloads())
        return part

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(
                f"PrefetchCache({str(self.dir)!r}) was closed; make a new PrefetchCache "
                "for that folder to read through it again."
            )

    def _pause(self, seconds: float) -> None:
        """Sleeps `seconds`, or raises `CacheClosedError` as soon as the cache closes."""
        self._check_open()
        if self._part().wait(seconds):
            self._check_open()

    def _quiet_get(self, url: str) -> None:
        with contextlib.suppress(Exception):  # a failed prefetch is retried on demand by get()
            self.get(url)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_parts={}, _fs={}, _adapt=None)
        return state
