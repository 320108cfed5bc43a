"""Retries: a 429 or 503 answer's `Retry-After` is waited, found on the error or its causes
(fsspec's HTTP `info()` raises `FileNotFoundError` from the 429 it got); a plain missing object
is still not retried."""

from __future__ import annotations

import pytest

from recipes.common.remote.request_pacing import RequestPacer
from recipes.common.remote.retries import call_with_retries, is_transient, retry_after


class Answer(Exception):
    """An aiohttp-like response error: `status` and `headers`."""

    def __init__(self, status: int, headers: dict | None = None):
        super().__init__(status)
        self.status = status
        self.headers = headers or {}


def busy_then_missing() -> FileNotFoundError:
    try:
        raise Answer(429, {"Retry-After": "7"})
    except Answer as answer:
        try:
            raise FileNotFoundError("http://host/a.parquet") from answer
        except FileNotFoundError as error:
            return error


def test_retry_after_is_read_from_the_error_or_its_causes():
    assert retry_after(Answer(503, {"Retry-After": "2.5"})) == 2.5
    assert retry_after(busy_then_missing()) == 7.0
    assert retry_after(Answer(500, {"Retry-After": "2"})) is None  # only 429 and 503
    assert retry_after(Answer(429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 120.0
    botocore_like = Exception("SlowDown")
    botocore_like.response = {
        "ResponseMetadata": {"HTTPStatusCode": 503, "HTTPHeaders": {"retry-after": "1"}}
    }
    assert retry_after(botocore_like) == 1.0


def test_busy_is_transient_and_missing_is_not():
    assert is_transient(busy_then_missing())
    assert not is_transient(FileNotFoundError("gone"))
    assert not is_transient(Answer(404))
    assert is_transient(Answer(429)) and is_transient(Answer(503))


def test_the_wait_is_what_the_server_asked():
    waits = []
    calls = iter([Answer(429, {"Retry-After": "3"}), Answer(503), None])

    def call():
        error = next(calls)
        if error is not None:
            raise error
        return "done"

    assert call_with_retries(call, retries=3, backoff=0.01, sleep=waits.append) == "done"
    assert 3.0 <= waits[0] < 3.01  # Retry-After, not the 0.01 s backoff
    assert waits[1] < 0.031  # the backoff: 0.01 x 2 x jitter


def test_the_pacer_spaces_requests_and_holds_them(monkeypatch):
    now = [100.0]
    slept = []
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    monkeypatch.setattr("time.sleep", slept.append)
    pacer = RequestPacer(4.0)
    for _ in range(3):
        pacer.wait()
    assert slept == [0.25, 0.5]
    pacer.hold(2.0)
    pacer.wait()
    assert slept[-1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="`per_second` must be positive"):
        RequestPacer(0)


def test_an_httpx_style_429_is_busy_and_its_retry_after_is_read():
    """huggingface_hub raises an OSError whose `response` is an httpx response: its 429 and
    Retry-After count (the Hub's listing answers 429 under load)."""
    import types

    from recipes.common.remote.retries import is_transient, response_status, retry_after

    class HubError(OSError):
        pass

    error = HubError("429 Too Many Requests")
    error.response = types.SimpleNamespace(status_code=429, headers={"Retry-After": "3"})
    assert response_status(error) == 429 and is_transient(error) and retry_after(error) == 3.0
