"""Retries with exponential backoff and jitter, for the transient errors of remote storage.

Use when: a remote call (a download attempt, one ranged GET) fails now and then with a
connection reset, a timeout, an HTTP 5xx or a body cut short, and should be tried again,
while a missing object, a refused argument or a full disk should fail at once.
Cost: the waits between attempts: `backoff * 2**attempt`, times a jitter in [0.5, 1.5), or
the server's `Retry-After` when it answered 429 or 503 with one (at most `MAX_RETRY_AFTER`).
Adapt here: `is_transient` and `retry_after`, for your storage's error types.
Trade-off: a fixed number of attempts, no overall deadline; the jitter spreads the retries
of many workers that hit one server at once, at the price of a less predictable wait.
A response's status is found on the error or on its causes: fsspec's HTTP `info()` raises
`FileNotFoundError` from the 429 it got, which is busy, not missing.
Copy with: nothing.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_RETRY_AFTER = 120.0  # seconds: a longer `Retry-After` is waited this long, then retried
BUSY = (429, 503)  # the statuses whose `Retry-After` is honoured


class StopRetrying(Exception):
    """Raised by a call or a `sleep` to end the retries at once (a shutdown, a fallback):
    `call_with_retries` passes it on as it is."""


def is_transient(error: BaseException) -> bool:
    """Worth retrying: network errors, 5xx, short bodies. Not: missing objects, permissions,
    refused arguments, a full disk, interrupts, `StopRetrying`, an error marked
    `transient = False` (a checksum that differs again: damage at the source)."""
    status = response_status(error)
    busy = isinstance(status, int) and (status >= 500 or status in (408, 429))
    if busy and isinstance(error, Exception) and not isinstance(error, StopRetrying):
        return getattr(error, "transient", None) is not False  # busy or failing, not missing
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
    # a refusal is the error's own 4xx, not a cause's: aiohttp wraps a body cut short
    # (transient) around a parser error of "status" 400
    own = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(own, int) and 400 <= own < 500:
        return False
    return isinstance(error, Exception)


def _causes(error: BaseException):
    """`error`, then its causes (`raise ... from`), a few deep; not the errors it was raised
    while handling (a refused argument raised in an `except` block is not busy)."""
    seen = 0
    while error is not None and seen < 5:
        yield error
        error = error.__cause__
        seen += 1


def response_status(error: BaseException) -> int | None:
    """The HTTP status of the response behind `error` (aiohttp's `status`, botocore's
    `response`, urllib's `code`, httpx's and requests' `response.status_code`), looked for on
    the error and its causes; None if none."""
    for cause in _causes(error):
        status = getattr(cause, "status", None) or getattr(cause, "code", None)
        response = getattr(cause, "response", None)
        if status is None and isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status is None and response is not None:  # httpx and requests (huggingface_hub)
            status = getattr(response, "status_code", None)
        if isinstance(status, int):
            return status
    return None


def retry_after(error: BaseException) -> float | None:
    """The seconds a 429 or 503 response asked to wait (`Retry-After` in seconds; an HTTP date
    counts as `MAX_RETRY_AFTER`), from the error or its causes; None if it asked nothing."""
    if response_status(error) not in BUSY:
        return None
    for cause in _causes(error):
        headers = getattr(cause, "headers", None)
        response = getattr(cause, "response", None)
        if headers is None and isinstance(response, dict):
            headers = response.get("ResponseMetadata", {}).get("HTTPHeaders")
        if headers is None and response is not None:  # httpx and requests (huggingface_hub)
            headers = getattr(response, "headers", None)
        if not headers:
            continue
        value = headers.get("Retry-After") or headers.get("retry-after")
        if value is None:
            continue
        try:
            return min(max(float(value), 0.0), MAX_RETRY_AFTER)
        except ValueError:
            return MAX_RETRY_AFTER
    return None


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
        backoff: the first retry's delay in seconds; doubled each retry, with jitter; a 429 or
            503 with `Retry-After` waits what it says instead (`retry_after`).
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
            asked = retry_after(error)
            if not is_transient(error):
                raise
            if attempt == retries:
                if final is None:
                    raise
                raise final(retries + 1, error) from error
        wait = backoff * 2**attempt * (0.5 + random.random())
        if asked is not None:  # the server said when: no sooner (jitter only adds)
            wait = asked + backoff * random.random()
        sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")
