"""Retries with exponential backoff and jitter, for the transient errors of remote storage.

Use when: a remote call (a download attempt, one ranged GET) fails now and then with a
connection reset, a timeout, an HTTP 5xx or a body cut short, and should be tried again,
while a missing object, a refused argument or a full disk should fail at once.
Cost: the waits between attempts: `backoff * 2**attempt`, times a jitter in [0.5, 1.5).
Adapt here: `is_transient`, for your storage's error types.
Trade-off: a fixed number of attempts, no overall deadline; the jitter spreads the retries
of many workers that hit one server at once, at the price of a less predictable wait.
Copy with: nothing.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StopRetrying(Exception):
    """Raised by a call or a `sleep` to end the retries at once (a shutdown, a fallback):
    `call_with_retries` passes it on as it is."""


def is_transient(error: BaseException) -> bool:
    """Worth retrying: network errors, 5xx, short bodies. Not: missing objects, permissions,
    refused arguments, a full disk, interrupts, `StopRetrying`, an error marked
    `transient = False` (a checksum that differs again: damage at the source)."""
    if (
        isinstance(
            error,
            (
                FileNotFoundError,
                PermissionError,
                IsADirectoryError,
                ValueError,
                KeyboardInterrupt,
                SystemExit,
                GeneratorExit,
                StopRetrying,
            ),
        )
        or getattr(error, "transient", None) is False
    ):
        return False
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return False
    return isinstance(error, Exception)


def call_with_retries(
    call: Callable[[], T],
    *,
    retries: int,
    backoff: float,
    sleep: Callable[[float], None] = time.sleep,
    final: Callable[[int, BaseException], BaseException] | None = None,
) -> T:
    """`call()`, tried again after transient errors, at most `retries` times.

    Args:
        call: the work; it cleans up after itself when it raises.
        retries: retries after the first attempt.
        backoff: the first retry's delay in seconds; doubled each retry, with jitter.
        sleep: waits between attempts (raise `StopRetrying` from it to give up early).
        final: builds the error raised when every attempt failed, from the number of attempts
            and the last error (raised `from` it); None: the last error itself.

    Returns:
        What `call()` returned.

    Raises:
        The first error that is not transient at once; once the attempts run out, the last
        error (or `final`'s).
    """
    for attempt in range(retries + 1):
        try:
            return call()
        except BaseException as error:
            if not is_transient(error):
                raise
            if attempt == retries:
                if final is None:
                    raise
                raise final(retries + 1, error) from error
        sleep(backoff * 2**attempt * (0.5 + random.random()))
    raise AssertionError("unreachable: the last attempt returns or raises")
