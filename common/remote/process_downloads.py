"""One process's downloads of a cache: its background download threads, the prefetches queued
in them, the `get`s running in callers' threads, and how a close stops them all.

Use when: you read what `PrefetchCache.prefetch` starts and what `PrefetchCache.close` waits
for. Threads and locks do not survive a fork, so each process (the main one, each forked
DataLoader worker) makes its own `ProcessDownloads` on first use.
Cost: a thread pool of `prefetch` threads, made on the first prefetch; a condition and an event.
Adapt here: `_FORGET_AFTER` (finished prefetches remembered per download thread).
Trade-off: a close cancels queued prefetches and wakes running downloads at their next block,
range or retry wait; it does not interrupt a read in progress, so it returns after at most one
block per download.
Copy with: nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

# finished prefetches are forgotten once more than this many per download thread are held
_FORGET_AFTER = 8


class ProcessDownloads:
    """One process's share of a cache: its download threads and the downloads running in it.
    Each method that starts work takes `check`, which raises once the cache is closed: checked
    under the same lock `stop` takes, so nothing starts after a close began."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
        self._running = 0  # `get`s waiting for a key or downloading, in this process
        self._idle = threading.Condition()
        self._closing = threading.Event()

    @contextlib.contextmanager
    def running(self, check: Callable[[], None]):
        """Counts a `get` that waits for a key or downloads: `stop` waits for it (and wakes it)."""
        with self._idle:  # checked and counted at once: `stop` waits for each one not refused
            check()
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def submit(
        self, url: str, get: Callable[[str], None], *, threads: int, check: Callable[[], None]
    ) -> Future:
        """`get(url)` in a background thread (at most `threads` at once), unless one for `url`
        is queued or running: its future then."""
        with self._idle:  # against `stop`: no pool made nor download queued after it began
            check()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="recipes-prefetch")
            if len(self._inflight) > _FORGET_AFTER * threads:  # forget finished downloads
                self._inflight = {u: f for u, f in self._inflight.items() if not f.done()}
            running = self._inflight.get(url)
            if running is None or running.done():
                running = self._pool.submit(get, url)
                self._inflight[url] = running
            return running

    def wait(self, seconds: float) -> bool:
        """Sleeps `seconds`; True as soon as `stop` began (the wait cut short)."""
        return self._closing.wait(seconds)

    def stop(self) -> None:
        """Cancels queued prefetches, wakes running downloads (retry waits, lock polls), joins
        the download threads and waits for the `get`s running in callers' threads. Called after
        the cache is marked closed, so every later `check` raises."""
        with self._idle:  # after any `submit` holding it: each sees the close next, so no pool
            pool = self._pool  # is made later
        if pool is not None:
            # queued prefetches cancelled first: a running one woken below would end and its
            # thread take the next one
            pool.shutdown(wait=False, cancel_futures=True)
        with self._idle:  # after any `running` holding it
            self._closing.set()  # wakes retry waits and lock polls
        if pool is not None:
            pool.shutdown(wait=True)
        with self._idle:  # `get`s waiting or downloading in callers' threads
            self._idle.wait_for(lambda: self._running == 0)
