"""RequestPacer: at most `per_second` requests from this process, and none while a server's
`Retry-After` runs.

Use when: many workers and ranks read one service that throttles (the Hugging Face Hub answers
429 past a rate; S3 answers 503 "Slow Down" per prefix), and a burst of retries would only
lengthen the throttling.
Cost: a lock and a clock read per request; a sleep when ahead of the rate.
Adapt here: `per_second` (the job's budget divided by its processes: ranks x workers).
Trade-off: per process, not per job: a job of P processes sends at most P x `per_second`.
A shared budget would need a rendezvous between the processes of every node.
Copy with: nothing.
"""

from __future__ import annotations

import threading
import time


class RequestPacer:
    """Spaces this process's requests at least `1 / per_second` apart, and holds them all while a
    server's `Retry-After` runs (`hold`).

    Args:
        per_second: requests per second at most; None: no cap (only `hold` waits).

    Raises:
        ValueError: `per_second` not positive.

    Example:
        >>> pacer = RequestPacer(20.0)
        >>> pacer.wait()  # before each request
    """

    def __init__(self, per_second: float | None = None):
        if per_second is not None and not per_second > 0:
            raise ValueError(f"`per_second` must be positive, but is {per_second!r} instead.")
        self.per_second = per_second
        self._next = 0.0  # monotonic time of the next free slot
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Blocks until this process may send its next request, and takes that slot."""
        interval = 0.0
        if self.per_second is not None:
            interval = 1.0 / self.per_second
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + interval
        if start > now:
            time.sleep(start - now)

    def hold(self, seconds: float) -> None:
        """No request of this process starts in the next `seconds` (a 429's `Retry-After`)."""
        with self._lock:
            self._next = max(self._next, time.monotonic() + seconds)

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]  # each process paces its own requests
        state["_next"] = 0.0
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
