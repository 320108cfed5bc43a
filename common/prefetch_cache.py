"""PrefetchCache: a crash-safe, size-bounded, process-shared local cache for remote objects.

Use when: training reads shards from object storage or HTTP and you want each shard
downloaded once per node (all workers and ranks share it), ahead of time, and never served
half-written. fsspec's `simplecache`/`filecache` write straight to the final path, so a crash
or a concurrent reader sees a partial file (fsspec#639: 69 of 80 concurrent reads corrupt).
Cost: one download per object per node; background threads (`prefetch` at a time) per process;
an flock per access; a directory scan when space must be freed.
Adapt here: `_ALLOWED` protocols, `_is_transient` for your storage's error types.
Trade-off: whole objects are cached (no partial reads of huge objects); LRU by access time.
An object larger than `range_bytes` is fetched as concurrent ranged GETs (each range retried
on its own), as s5cmd and the AWS CLI do: object stores cap each connection's bandwidth, not
each client's. How many ranges of one object are in flight adapts: it starts at
`range_connections` and doubles while each doubling raises the measured rate by 15%, up to
`max_connections` (`concurrency()` reports the level chosen). One search per cache object:
the processes that share it (forked or spawned DataLoader workers) share its whole state.
One fsspec filesystem per process serves every download, its connection pool sized to
`prefetch x max_connections` (s3fs's default pool of 10 would cap the ranges otherwise).

How it holds up:
- download to `.tmp.<pid>.<nonce>.<size>.<key>` in the cache folder, fsync, `os.replace`;
  sizes are checked against the remote's and an optional sha256 is verified;
- one exclusive flock per key: the first process downloads, the others wait and read it;
- readers pin a file with a shared flock (`pinned(url)`); eviction skips pinned files;
- downloads may run in the main process's threads while DataLoader workers fork (the early
  start of `ShardedIterableDataset.set_epoch`): the lock and temp-file descriptors those
  threads hold are closed in the child at fork, so a worker never inherits a held lock nor
  a download's file. Every download, ranged or whole, writes through the one temp-file
  descriptor the cache opens (fsspec's `get_file` would open its own, out of reach);
- transient errors (connection resets, timeouts, HTTP 5xx, short bodies) retry with
  exponential backoff and jitter; the final error names the URL and the attempts; a full
  disk removes the temp file and raises; temp files of dead processes are swept on start;
- file names are sha256 hashes of the URL (no path traversal); the folder is `0o700`;
  `pipe:`, chained (`a::b`) and unknown protocols are refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from recipes.common.cache_files import fsync_path
from recipes.common.process_lifetime import pid_alive

_ALLOWED = {"file", "local", "http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
_TEMP = re.compile(r"^\.tmp\.(\d+)\.[0-9a-f]+\.(\d+)\.[0-9a-f]+$")

# Descriptors (flocks, temp files) this process's threads hold right now. A fork copies them
# into the child, where no thread will close them: an inherited flock would then stay held for
# the child's lifetime and deadlock the next `get` of that key. They are closed in the child.
# Opening and registering (and unregistering and closing) happen under `_FORK_LOCK`, which a
# fork takes first: no fork lands between a descriptor's `open` and its registration.
_HELD: dict[int, object] = {}
_FORK_LOCK = threading.Lock()


def _close_held_after_fork() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _FORK_LOCK.release()  # taken by the forking thread (`before`)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_FORK_LOCK.acquire, after_in_parent=_FORK_LOCK.release,
                        after_in_child=_close_held_after_fork)


def _open_held(path, flags: int) -> tuple[int, object]:
    with _FORK_LOCK:
        fd = os.open(path, flags, 0o600)
        token = _HELD[fd] = object()
    return fd, token


def _release(fd: int, token: object) -> None:
    """Closes `fd` unless a fork closed it already (then the number may be another file's)."""
    with _FORK_LOCK:
        if _HELD.get(fd) is token:
            del _HELD[fd]
            os.close(fd)


class DownloadError(OSError):
    """A download that failed after every retry; names the URL, the attempts and the last error."""


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
        >>> cache = PrefetchCache("/local/nvme/shards", max_bytes=200 * 2**30)
        >>> cache.prefetch(urls[1:5])
        >>> with cache.pinned(urls[0]) as path:
        ...     data = path.read_bytes()
    """

    def __init__(self, cache_dir, *, max_bytes: int, prefetch: int = 4, retries: int = 5,
                 backoff: float = 0.5, storage_options: dict | None = None, range_bytes: int = 2 * 2**20,
                 range_connections: int = 4, max_connections: int = 16):
        for name, value in (("max_bytes", max_bytes), ("prefetch", prefetch), ("range_bytes", range_bytes),
                            ("range_connections", range_connections), ("max_connections", max_connections)):
            if value <= 0:
                raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
        if max_connections < range_connections:
            raise ValueError(f"`max_connections` ({max_connections}) must be at least `range_connections` "
                             f"({range_connections}).")
        if retries < 0 or backoff < 0:
            raise ValueError(f"`retries` and `backoff` must be non-negative, but are {retries!r} and {backoff!r}.")
        self.dir = Path(cache_dir)
        self.max_bytes, self.depth, self.retries, self.backoff = max_bytes, prefetch, retries, backoff
        self.storage_options = dict(storage_options or {})
        self.range_bytes, self.range_connections = range_bytes, range_connections
        self.max_connections = max_connections
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        (self.dir / ".locks").mkdir(exist_ok=True, mode=0o700)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None
        self._inflight: dict[str, Future] = {}
        self._paths: dict[str, Path] = {}
        # hits, misses, bytes downloaded: shared memory, so forked and spawned DataLoader
        # workers add to the counts the main process reads (`stats()`, `LoaderMonitor`).
        self._counts = torch.zeros(3, dtype=torch.int64).share_memory_()
        # The adapted level (ranges of one object in flight) and the rest of its search, shared:
        # workers forked later start from what the main process (or an earlier worker) learned,
        # and all of them run one search (issue 19).
        self._level = torch.tensor([range_connections], dtype=torch.int64).share_memory_()
        self._search = _Adapt.new_search(self._level, max_connections)
        self._fs: dict = {}
        self._adapt: _Adapt | None = None
        self.sweep()

    # ---- public API --------------------------------------------------------------------
    def path_for(self, url: str) -> Path:
        """Where `url` is cached: a hash of the URL, inside the cache folder."""
        path = self._paths.get(url)
        if path is None:
            path = self._paths[url] = self.dir / _key(url)
        return path

    def get(self, url: str, *, sha256: str | None = None) -> Path:
        """A local, complete copy of `url`, downloading it first if needed.

        Raises:
            ValueError: a refused protocol, or an object larger than `max_bytes`.
            FileNotFoundError: the object does not exist.
            DownloadError: transient failures outlasted the retries.
        """
        check_url(url)
        final = self.path_for(url)
        if _touch(final):
            self._count(hits=1)
            return final
        with self._key_lock(final.name, fcntl.LOCK_EX):
            if _touch(final):  # another process or thread finished it while we waited
                self._count(hits=1)
                return final
            self._download(url, final, sha256)
        self._count(misses=1, downloaded=final.stat().st_size)
        return final

    def connect(self, url: str) -> None:
        """Imports `url`'s filesystem and opens its client now (s3fs: ~0.3 s to import, ~0.1 s
        to connect in a fresh process), so that the first download does not wait for them:
        call it once at setup, e.g. before building the model. Optional: the first download
        does it otherwise."""
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
        with self._key_lock("stats", fcntl.LOCK_EX):
            self._counts += torch.tensor([hits, misses, downloaded])

    @contextlib.contextmanager
    def pinned(self, url: str, *, sha256: str | None = None):
        """`get(url)`, holding a shared lock so eviction leaves the file alone meanwhile."""
        for _ in range(5):
            path = self.get(url, sha256=sha256)
            with self._key_lock(path.name, fcntl.LOCK_SH):
                if path.exists():
                    yield path
                    return
        raise DownloadError(f"{url}: evicted again and again before it could be read; raise max_bytes.")

    def prefetch(self, urls: Iterable[str]) -> list[Future]:
        """Starts background downloads (at most `prefetch` at once); errors surface on `get`."""
        futures = []
        for url in urls:
            if os.path.exists(self.path_for(url)):
                continue
            # The filesystem (and its imports) is made here, in the caller's thread: a fork
            # (DataLoader workers) while a background thread is half-way through an import
            # could leave the child a held import lock. `connect()` opens the client too.
            self._filesystem(url)
            pool = self._executor()
            if len(self._inflight) > 8 * self.depth:  # forget finished downloads
                self._inflight = {u: f for u, f in self._inflight.items() if not f.done()}
            running = self._inflight.get(url)
            if running is None or running.done():
                self._inflight[url] = running = pool.submit(self._quiet_get, url)
            futures.append(running)
        return futures

    def sweep(self) -> int:
        """Removes temp files whose writer process is gone; returns how many."""
        removed = 0
        for entry in os.scandir(self.dir):
            match = _TEMP.match(entry.name)
            if match and not pid_alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def used_bytes(self) -> int:
        """Bytes of complete files plus reservations of downloads in flight."""
        total = 0
        for entry in os.scandir(self.dir):
            match = _TEMP.match(entry.name)
            if match:
                total += int(match.group(2))
            elif entry.is_file() and not entry.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                    total += entry.stat().st_size
        return total

    # ---- downloading -------------------------------------------------------------------
    def _download(self, url: str, final: Path, sha256: str | None) -> None:
        fs, remote = self._filesystem(url)
        attempts, last = self.retries + 1, None
        for attempt in range(attempts):
            tmp = held = None
            try:
                size = fs.info(remote).get("size")
                if size is not None and size > self.max_bytes:
                    raise ValueError(f"{url} is {size:,} bytes, over the cache's max_bytes={self.max_bytes:,}; "
                                     "raise max_bytes or read it without the cache.")
                tmp, *held = self._reserve(final.name, size or 0)
                fd = held[0]  # the temp file's only descriptor: written, verified and synced through it
                if size is not None and size > self.range_bytes and self.range_connections > 1:
                    try:
                        self._ranged_get(fs, remote, url, fd, size)
                    except _NoRanges:  # the server ignores Range: one whole-object GET
                        self._whole_get(fs, remote, fd, size)
                else:
                    self._whole_get(fs, remote, fd, size)
                _verify(url, fd, size, sha256)
                os.fsync(fd)
                os.replace(tmp, final)
                fsync_path(self.dir)
                return
            except BaseException as error:
                if tmp is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                if not _is_transient(error):
                    raise
                last = error
            finally:
                if held:
                    _release(*held)
            if attempt + 1 < attempts:
                time.sleep(self.backoff * 2**attempt * (0.5 + random.random()))
        raise DownloadError(f"{url}: failed after {attempts} attempts; last error: "
                            f"{type(last).__name__}: {last}") from last

    def _filesystem(self, url: str):
        """(filesystem, path): one fsspec filesystem per process and protocol, reused."""
        import fsspec

        protocol = fsspec.utils.get_protocol(url)
        key = (os.getpid(), protocol)
        fs = self._fs.get(key)
        if fs is None:
            options = dict(self.storage_options)
            if protocol in ("s3", "s3a"):  # botocore's pool (10) would queue the ranges
                config = dict(options.get("config_kwargs") or {})
                config.setdefault("max_pool_connections", self.depth * self.max_connections)
                options["config_kwargs"] = config
            fs, _ = fsspec.core.url_to_fs(url, **options)
            self._fs = {k: v for k, v in self._fs.items() if k[0] == os.getpid()}  # drop a parent's
            self._fs[key] = fs
        return fs, fs._strip_protocol(url)

    def _whole_get(self, fs, remote: str, fd: int, size: int | None) -> None:
        """`remote` into the temp file `fd` front to back (see `_open_stream`); the caller
        verifies and renames."""
        os.ftruncate(fd, 0)  # what a ranged attempt wrote before it found no Range support
        offset = 0
        with _open_stream(fs, remote, size) as source:
            while block := source.read(_BLOCK):
                _pwrite_all(fd, block, offset)
                offset += len(block)

    def _ranged_get(self, fs, remote: str, url: str, fd: int, size: int) -> None:
        """`size` bytes of `remote` into the temp file `fd` as `range_bytes` ranges, the adapted
        number of them in flight at once (object stores cap each connection, not each
        client), each written at its offset and retried on its own; the caller verifies and
        renames."""
        ranges = [(start, min(start + self.range_bytes, size)) for start in range(0, size, self.range_bytes)]
        level = int(self._level.item())
        began = time.perf_counter()
        os.ftruncate(fd, size)

        def fetch(span):
            start, end = span
            for attempt in range(self.retries + 1):
                try:
                    data = fs.cat_file(remote, start=start, end=end)
                    if len(data) > end - start:
                        raise _NoRanges(url)
                    if len(data) < end - start:
                        raise _ShortBody(f"{url}: range {start}-{end} gave {len(data):,} of {end - start:,} bytes")
                    _pwrite_all(fd, data, start)
                    return
                except BaseException as error:
                    if isinstance(error, _NoRanges) or not _is_transient(error) or attempt == self.retries:
                        raise
                time.sleep(self.backoff * 2**attempt * (0.5 + random.random()))

        # Leaving the `with` waits for the running ranges: none writes after the caller closes `fd`.
        with ThreadPoolExecutor(min(level, len(ranges)), thread_name_prefix="recipes-range") as pool:
            futures = [pool.submit(fetch, span) for span in ranges]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        if len(ranges) > level:  # the level limited this download: its rate says whether more helps
            self._adapter().observe(level, size / (time.perf_counter() - began))

    def _adapter(self) -> _Adapt:
        if self._adapt is None:  # stateless but for the shared tensors: fine in a forked child too
            lock = functools.partial(self._key_lock, "adapt", fcntl.LOCK_EX)  # excludes threads and processes
            self._adapt = _Adapt(self._level, self.max_connections, search=self._search, lock=lock)
        return self._adapt

    def _reserve(self, key: str, size: int) -> tuple[Path, int, object]:
        """Frees room for `size` bytes (LRU, skipping pinned files) and creates the temp file
        whose name carries the reservation, under one folder-wide lock. Returns its path and
        its held descriptor `(fd, token)`, for `_release`."""
        deadline = time.monotonic() + 60
        while True:
            with self._key_lock("evict", fcntl.LOCK_EX):
                if self._evict_until(self.max_bytes - size):
                    tmp = self.dir / f".tmp.{os.getpid()}.{secrets.token_hex(4)}.{size}.{key}"
                    return (tmp, *_open_held(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL))
            if time.monotonic() > deadline:
                raise DownloadError(f"no room for {size:,} bytes in {self.dir}: the files in use fill "
                                    f"max_bytes={self.max_bytes:,}; raise max_bytes or read fewer shards at once.")
            time.sleep(0.2)

    def _evict_until(self, budget: int) -> bool:
        used = self.used_bytes()
        if used <= budget:
            return True
        files = [e for e in os.scandir(self.dir) if e.is_file() and not e.name.startswith(".")]
        for entry in sorted(files, key=lambda e: e.stat().st_mtime_ns):  # least recently used first
            lock, token = _open_held(self.dir / ".locks" / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not pinned, not downloading
            except BlockingIOError:
                _release(lock, token)
                continue
            try:
                size = entry.stat().st_size
                os.unlink(entry.path)
                used -= size
            except FileNotFoundError:
                pass
            finally:
                _release(lock, token)
            if used <= budget:
                return True
        return False

    @contextlib.contextmanager
    def _key_lock(self, name: str, mode: int):
        # A new open file description per call: threads of one process exclude each other too.
        fd, token = _open_held(self.dir / ".locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            _release(fd, token)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool_pid != os.getpid():  # threads do not survive fork
            self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="recipes-prefetch")
            self._pool_pid, self._inflight = os.getpid(), {}
        return self._pool

    def _quiet_get(self, url: str) -> None:
        with contextlib.suppress(Exception):  # a failed prefetch is retried on demand by get()
            self.get(url)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_pool=None, _pool_pid=None, _inflight={}, _fs={}, _adapt=None)
        return state


class _Adapt:
    """Raises the ranges in flight per object while it pays: each level is kept only if its
    download rate beats the level below by 15%; the first level that does not is undone and
    the search stops (rates at a stale level, from downloads begun before a change, are
    ignored).

    The whole search is shared by the processes that share the cache: the level (`level`,
    int64 [1]) and `search` (float64 [3]: the level to beat or 0, its rate, settled), both in
    shared memory, read and written under `lock`. Kept per process, the rate to beat and the
    settled flag let each process take the next step from its own view (issue 19: three
    workers on a link saturating at 4 ranges went 2, 4, 8, 16, and one raised the level again
    after another had settled it).

    Args:
        level: the level, shared.
        cap: the highest level (`max_connections`).
        search: the rest of the state, from `new_search`; None: a new one (one process).
        lock: a zero-argument callable returning a context manager that excludes every thread
            and process sharing the state (the cache passes an flock); None: a thread lock, for
            one process.
    """

    GAIN = 1.15

    def __init__(self, level: torch.Tensor, cap: int, *, search: torch.Tensor | None = None, lock=None):
        self.level, self.cap = level, cap
        self.search = self.new_search(level, cap) if search is None else search
        if lock is None:
            local = threading.Lock()
            lock = lambda: local  # noqa: E731
        self.lock = lock

    @staticmethod
    def new_search(level: torch.Tensor, cap: int) -> torch.Tensor:
        return torch.tensor([0.0, 0.0, float(int(level.item()) >= cap)], dtype=torch.float64).share_memory_()

    @property
    def settled(self) -> bool:
        return bool(self.search[2].item())

    def observe(self, level: int, rate: float) -> None:
        if self.settled or level != int(self.level.item()):  # without the lock: settled never ends
            return
        with self.lock():
            below_level, below_rate, settled = self.search.tolist()
            if settled or level != int(self.level.item()):
                return
            if below_level and rate < below_rate * self.GAIN:
                self.level.fill_(int(below_level))  # no gain: back down, and stay
                self.search[2] = 1.0
                return
            self.search[0], self.search[1] = float(level), float(rate)
            if level >= self.cap:
                self.search[2] = 1.0
            else:
                self.level.fill_(min(2 * level, self.cap))


@functools.lru_cache(maxsize=65536)
def _key(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:40]


@functools.lru_cache(maxsize=65536)
def check_url(url: str) -> None:
    """Refuses `pipe:` commands, chained URLs and protocols outside the allow-list."""
    if "::" in url:
        raise ValueError(f"Refusing chained URL {url!r}; pass the plain remote URL.")
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*):", url)
    if match and len(match.group(1)) > 1:  # one letter is a Windows drive
        protocol = match.group(1).lower()
        if protocol not in _ALLOWED:
            raise ValueError(f"Refusing {url!r}: protocol {protocol!r} is not one of {sorted(_ALLOWED)}.")


def _touch(path: Path) -> bool:
    """Marks `path` as just used (LRU) and says whether it exists."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


_BLOCK = 4 * 2**20  # bytes per read of a whole-object download


def _open_stream(fs, remote: str, size: int | None):
    """`remote` opened for one front-to-back read: over http(s) one streamed GET (fsspec's
    random-access HTTP file would send ranged GETs, which a server may not support);
    elsewhere the filesystem's own file, each `_BLOCK` read one request (no read-ahead)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"http", "https"} & set(protocols):
        return fs.open(remote, "rb", block_size=0, size=size)
    return fs.open(remote, "rb", block_size=_BLOCK, cache_type="none")


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset`: a write may stop short (a nearly full disk writes what fits
    before it fails), and a short write ignored would leave a hole of zeros in the file."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"a write at byte {offset:,} of a download wrote nothing")
        view, offset = view[written:], offset + written


def _verify(url: str, fd: int, size: int | None, sha256: str | None) -> None:
    actual = os.fstat(fd).st_size
    if size is not None and actual != size:
        raise _ShortBody(f"{url}: got {actual:,} of {size:,} bytes")
    if sha256 is not None:
        digest, offset = hashlib.sha256(), 0
        while block := os.pread(fd, 1 << 20, offset):
            digest.update(block)
            offset += len(block)
        if digest.hexdigest() != sha256:
            raise _ChecksumMismatch(f"{url}: sha256 {digest.hexdigest()} differs from the expected {sha256}")


class _ShortBody(OSError):
    pass


class _ChecksumMismatch(OSError):
    pass


class _NoRanges(Exception):
    """The server answered a range request with more than the range (no Range support)."""


def _is_transient(error: BaseException) -> bool:
    """Worth retrying: network errors, 5xx, short bodies. Not: missing objects, permissions,
    refused arguments, a full disk, interrupts."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, ValueError, KeyboardInterrupt,
                          SystemExit, GeneratorExit)):
        return False
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return False
    return isinstance(error, Exception)
