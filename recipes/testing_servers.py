"""Fake servers on 127.0.0.1 for tests and benchmarks of remote reads: HTTP with faults,
moto's S3 server, and a proxy that makes loopback look like a link to an object store.

Use when: a test or benchmark reads through fsspec or s3fs and needs a real server (no mocks in
the client) with first-byte latency, a bandwidth cap, 503s, bodies cut short or request counts.
Cost: a thread per server and per connection; `s3_store_process` starts a Python process that
imports moto and holds the objects in memory.
Adapt here: `LocalHTTPServer`'s switches (per path and per range start), `ThrottlingProxy`'s
`latency` and `bandwidth`.
Trade-off: sleeps on loopback model latency and per-connection caps, not packet loss or
congestion. A server in the reader's own process shares its GIL and CPU time; measure rates
with `s3_store_process`, which starts this module as `python -m recipes.testing_servers`.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


class LocalHTTPServer:
    """A threaded HTTP server on 127.0.0.1 serving the files under `root`, with faults.

    For tests and benchmarks of remote (fsspec) reads against a real server: GET (with single
    byte ranges) and HEAD, plus switches a test can change at any time:

    Args:
        root: the folder served.
        latency: seconds slept before every response (object-store first-byte latency).
        bandwidth: bytes per second per connection (None: unlimited).
        fail_first: the first K GETs of each path answer 503.
        truncate_first: the first K full GETs of each path announce the full length but send half.

    Answers carry an `ETag` of the file's mtime and size (as nginx's): a rewrite changes it.

    `gets[path]` and `heads[path]` count the requests per path (path as in the URL), and
    `range_gets[(path, start)]` the ranged GETs per range start. Per range start, a test can
    set `fail_range[start] = K` (the first K answer 503), `short_range[start] = K` (the first K
    announce the range's length and send half) and `delay_range[start] = seconds`.

    Example:
        >>> with LocalHTTPServer(tmp_path, latency=0.02) as server:
        ...     fsspec.open(server.url("shard-0.bin")).open().read()
    """

    def __init__(
        self,
        root: str | Path,
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        fail_first: int = 0,
        truncate_first: int = 0,
    ):
        self.root = Path(root)
        self.latency = latency
        self.bandwidth = bandwidth
        self.fail_first = fail_first
        self.truncate_first = truncate_first
        self.gets: collections.Counter = collections.Counter()
        self.range_gets: collections.Counter = collections.Counter()
        self.fail_range: dict[int, int] = {}
        self.short_range: dict[int, int] = {}
        self.delay_range: dict[int, float] = {}
        self.heads: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self._server = None
        self._thread = None

    def __enter__(self) -> LocalHTTPServer:
        self._server = _FixtureHTTPServer(self)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def url(self, name: str = "") -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/{name}"

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _FixtureHTTPServer(http.server.ThreadingHTTPServer):
    """The stdlib server on a free port of 127.0.0.1, holding the `LocalHTTPServer` (`fixture`)
    whose files, switches and counters its `FaultInjectingHandler`s use."""

    daemon_threads = True

    def __init__(self, fixture: LocalHTTPServer):
        self.fixture = fixture
        super().__init__(("127.0.0.1", 0), FaultInjectingHandler)


class FaultInjectingHandler(http.server.BaseHTTPRequestHandler):
    """Answers one request for `LocalHTTPServer`: HEAD, GET of a whole file or of one byte
    range, with the faults, delays and counts of `self.server.fixture`."""

    server: _FixtureHTTPServer

    def log_message(self, *args):  # keep test output clean
        pass

    def _file(self) -> tuple[str, Path | None]:
        root = self.server.fixture.root
        rel = self.path.split("?")[0].lstrip("/")
        path = (root / rel).resolve()
        if root.resolve() not in path.parents or not path.is_file():
            return rel, None
        return rel, path

    def do_HEAD(self):
        fixture = self.server.fixture
        rel, path = self._file()
        with fixture.lock:
            fixture.heads[rel] += 1
        time.sleep(fixture.latency)
        if path is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("ETag", etag(path))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self):
        fixture = self.server.fixture
        rel, path = self._file()
        with fixture.lock:
            fixture.gets[rel] += 1
            count = fixture.gets[rel]
        time.sleep(fixture.latency)
        if path is None:
            self.send_error(404)
            return
        if count <= fixture.fail_first:
            self.send_error(503, "Slow Down")
            return
        data = path.read_bytes()
        match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:
            started = self._start_range(rel, data, int(match.group(1)), match.group(2))
            if started is None:
                return
            body, short = started
        else:
            body = data
            short = count <= fixture.fail_first + fixture.truncate_first
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag(path))
        self.end_headers()
        if short:
            body = body[: len(body) // 2]  # announce all, send half, hang up
        self._send(body)

    def _start_range(
        self, rel: str, data: bytes, start: int, end: str
    ) -> tuple[bytes, bool] | None:
        """Counts and delays a GET of `bytes=start-end`, then answers 503 (returns None) or
        sends the 206 status line and returns the range's bytes and whether to cut them short."""
        fixture = self.server.fixture
        with fixture.lock:
            fixture.range_gets[(rel, start)] += 1
            ranged = fixture.range_gets[(rel, start)]
        time.sleep(fixture.delay_range.get(start, 0.0))
        failing = fixture.fail_range.get(start, 0)
        if ranged <= failing:
            self.send_error(503, "Slow Down")
            return None
        stop = len(data)  # an open range ("bytes=START-") runs to the end
        if end:
            stop = min(int(end) + 1, len(data))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
        return data[start:stop], ranged <= failing + fixture.short_range.get(start, 0)

    def _send(self, body: bytes):
        bandwidth = self.server.fixture.bandwidth
        step = 64 * 1024
        for i in range(0, len(body), step):
            chunk = body[i : i + step]
            if bandwidth:  # each chunk arrives when the capped link would deliver it
                time.sleep(len(chunk) / bandwidth)
            try:
                self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                return


def etag(path: Path) -> str:
    info = path.stat()
    return f'"{info.st_mtime_ns:x}-{info.st_size:x}"'


class ThrottlingProxy:
    """A TCP proxy on 127.0.0.1 in front of `target` that makes loopback look like a network
    link to an object store: `latency` seconds before each request is forwarded (first-byte
    latency) and `bandwidth` bytes per second per connection on the way back (stores cap each
    connection, not each client).

    For benchmarks of S3 clients against moto's server, which answers at memory speed.

    Example:
        >>> with MotoS3Server() as s3:
        ...     with ThrottlingProxy(s3.port, latency=0.02, bandwidth=16 * 2**20) as proxy:
        ...         options = s3.storage_options(port=proxy.port)
    """

    def __init__(
        self,
        target_port: int,
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        target_host: str = "127.0.0.1",
    ):
        self.target = (target_host, target_port)
        self.latency = latency
        self.bandwidth = bandwidth
        self._listener = None
        self._thread = None

    def __enter__(self) -> ThrottlingProxy:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._pump, args=(client, upstream, self.latency, None), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, 0.0, self.bandwidth), daemon=True
            ).start()

    @staticmethod
    def _pump(source, sink, latency: float, bandwidth: float | None) -> None:
        ready = 0.0  # when the link has delivered what was sent so far
        try:
            while True:
                data = source.recv(256 * 1024)
                if not data:
                    break
                if latency:  # requests are small: one delay per request
                    time.sleep(latency)
                if bandwidth:  # pace to the cap; oversleeping is made up within 10 ms
                    now = time.monotonic()
                    ready = max(ready, now - 0.01) + len(data) / bandwidth
                    if ready > now:
                        time.sleep(ready - now)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class MotoS3Server:
    """moto's standalone S3 server on 127.0.0.1 (a real HTTP server, no mocks in the client),
    with `storage_options()` for s3fs and `client()` for boto3."""

    KEYS = {"key": "testing", "secret": "testing"}

    def __enter__(self) -> MotoS3Server:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    def storage_options(self, port: int | None = None) -> dict:
        """s3fs options for this server, or for a proxy in front of it on `port`."""
        return s3_storage_options(port or self.port)

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            region_name="us-east-1",
        )


def s3_storage_options(port: int | str) -> dict:
    """s3fs options for moto's server, or a proxy in front of it, on 127.0.0.1:`port`."""
    return {
        **MotoS3Server.KEYS,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }


@contextlib.contextmanager
def s3_store_process(
    folder: str | Path,
    names: list[str],
    *,
    bucket: str,
    latency: float = 0.0,
    bandwidth: float | None = None,
):
    """moto's S3 server holding `folder`'s `names` in `bucket`, behind a `ThrottlingProxy`,
    in a process of its own (so that serving does not take the reader's GIL or CPU time in
    its own process). Yields the s3fs storage options that reach it through the proxy."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recipes.testing_servers",
            str(folder),
            bucket,
            str(latency),
            str(bandwidth or 0),
            *names,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"the S3 store process failed to start (exit code {proc.poll()})")
        yield s3_storage_options(line[1])
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_s3_store(
    folder: str | Path,
    names: list[str],
    *,
    bucket: str,
    latency: float = 0.0,
    bandwidth: float | None = None,
) -> None:
    """The body of `s3_store_process`'s process: uploads `folder`'s `names` to `bucket` on a
    `MotoS3Server`, starts a `ThrottlingProxy` in front of it, prints "<store port> <proxy
    port>" and serves until stdin closes."""
    folder = Path(folder)
    with MotoS3Server() as store:
        client = store.client()
        client.create_bucket(Bucket=bucket)
        for name in names:
            client.put_object(Bucket=bucket, Key=name, Body=(folder / name).read_bytes())
        with ThrottlingProxy(store.port, latency=latency, bandwidth=bandwidth or None) as proxy:
            print(store.port, proxy.port, flush=True)
            sys.stdin.read()  # until the parent closes it


if (
    __name__ == "__main__"
):  # python -m recipes.testing_servers FOLDER BUCKET LATENCY BANDWIDTH NAME...
    _folder, _bucket, _latency, _bandwidth, *_names = sys.argv[1:]
    serve_s3_store(
        _folder,
        _names,
        bucket=_bucket,
        latency=float(_latency),
        bandwidth=float(_bandwidth) or None,
    )
