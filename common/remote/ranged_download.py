"""Ranged parallel downloads into one open file, and the search for how many to run at once.

Use when: an object store caps each connection's bandwidth, not each client's (S3, GCS,
Azure): an object fetched as concurrent ranged GETs arrives several times faster, as s5cmd
and the AWS CLI fetch it. `download_ranges` writes each range at its offset in a file the
caller opened (and later verifies, syncs and renames), each range retried on its own;
`ConcurrencySearch` doubles the ranges in flight while each doubling raises the measured
rate by 15%, and undoes the first doubling that does not pay.
Cost: one request per range; one thread per range in flight while a download runs; the file
is sized to the object's length first.
Adapt here: `ConcurrencySearch.GAIN`, the gain a doubling must bring.
Trade-off: a request per range (S3 prices requests); a server that ignores `Range` answers
with the whole object (`NoRangeSupport`: fetch it whole instead). The search settles once and
for all: a link that speeds up later is not searched again.
Copy with: common/caches/cache_folder.py, common/remote/object_download.py,
  common/remote/retries.py, common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from recipes.common.remote.object_download import ShortBody, pwrite_all
from recipes.common.remote.retries import StopRetrying, call_with_retries


class NoRangeSupport(StopRetrying):
    """The server answered a range request with more than the range (no Range support)."""


def _nothing() -> None:
    pass


def download_ranges(
    fs,
    remote: str,
    url: str,
    fd: int,
    size: int,
    *,
    range_bytes: int,
    search: ConcurrencySearch,
    retries: int,
    backoff: float,
    check: Callable[[], None] = _nothing,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """`size` bytes of `remote` into the file `fd` as `range_bytes` ranges, `search`'s level of
    them in flight, each written at its offset and retried on its own (`call_with_retries`).

    Args:
        fs: the fsspec filesystem; `remote`: the path on it; `url`: named in errors.
        fd: a file open for writing; resized to `size`; the caller verifies and renames it.
        search: the adapted level, told this download's rate when the level limited it.
        check: called before each range; raise (a `StopRetrying`) from it to stop early.
        sleep: waits between a range's attempts (see `call_with_retries`).

    Raises:
        NoRangeSupport: the server sent more than a range; fetch the object whole.
        ShortBody: a range came short every time.
    """
    ranges = [(start, min(start + range_bytes, size)) for start in range(0, size, range_bytes)]
    level = int(search.level.item())
    began = time.perf_counter()
    os.ftruncate(fd, size)

    def fetch(start: int, end: int) -> None:
        check()
        data = fs.cat_file(remote, start=start, end=end)
        if len(data) > end - start:
            raise NoRangeSupport(url)
        if len(data) < end - start:
            raise ShortBody(
                f"{url}: range {start}-{end} gave {len(data):,} of {end - start:,} bytes"
            )
        pwrite_all(fd, data, start)

    # Leaving the `with` waits for the running ranges: none writes after the caller closes `fd`.
    with ThreadPoolExecutor(min(level, len(ranges)), thread_name_prefix="recipes-range") as pool:
        futures = [
            pool.submit(
                call_with_retries,
                functools.partial(fetch, *span),
                retries=retries,
                backoff=backoff,
                sleep=sleep,
            )
            for span in ranges
        ]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    if len(ranges) > level:  # the level limited this download: its rate says whether more helps
        search.observe(level, size / (time.perf_counter() - began))


# The fields of a search's shared tensor (float64 [3]).
_BEST_LEVEL = 0  # the level to beat (the last one measured), or 0 before any
_BEST_RATE = 1  # its rate, bytes/s
_SETTLED = 2  # 1.0 once the level stays


class ConcurrencySearch:
    """Raises the ranges in flight per object while it pays: each level is kept only if its
    download rate beats the level below by 15%; the first level that does not is undone and
    the search stops (rates at a stale level, from downloads begun before a change, are
    ignored).

    The whole search can be shared by processes: the level (`level`, int64 [1]) and `search`
    (float64 [3]: the level to beat or 0, its rate, settled), both in shared memory, read and
    written under `lock`. Kept per process, the rate to beat and the settled flag let each
    process take the next step from its own view (issue 19: three workers on a link saturating
    at 4 ranges went 2, 4, 8, 16, and one raised the level again after another had settled it).

    Args:
        level: the level, shared.
        cap: the highest level (`max_connections`).
        search: the rest of the state, from `new_search`; None: a new one (one process).
        lock: a zero-argument callable returning a context manager that excludes every thread
            and process sharing the state (`PrefetchCache` passes an flock); None: a thread
            lock, for one process.
    """

    GAIN = 1.15

    def __init__(
        self, level: torch.Tensor, cap: int, *, search: torch.Tensor | None = None, lock=None
    ):
        self.level = level
        self.cap = cap
        if search is None:
            search = self.new_search(level, cap)
        self.search = search
        if lock is None:
            local = threading.Lock()

            def lock():
                return local

        self.lock = lock

    @staticmethod
    def new_search(level: torch.Tensor, cap: int) -> torch.Tensor:
        return torch.tensor(
            [0.0, 0.0, float(int(level.item()) >= cap)], dtype=torch.float64
        ).share_memory_()

    @property
    def settled(self) -> bool:
        return bool(self.search[_SETTLED].item())

    def observe(self, level: int, rate: float) -> None:
        """One download's `rate` (bytes/s) at `level` ranges in flight; may change the level."""
        if self.settled or level != int(self.level.item()):  # without the lock: settled never ends
            return
        with self.lock():
            below_level, below_rate, settled = self.search.tolist()
            if settled or level != int(self.level.item()):
                return
            if below_level and rate < below_rate * self.GAIN:
                self.level.fill_(int(below_level))  # no gain: back down, and stay
                self.search[_SETTLED] = 1.0
                return
            self.search[_BEST_LEVEL] = float(level)
            self.search[_BEST_RATE] = float(rate)
            if level >= self.cap:
                self.search[_SETTLED] = 1.0
            else:
                self.level.fill_(min(2 * level, self.cap))
