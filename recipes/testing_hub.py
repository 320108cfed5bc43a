"""A fake Hugging Face Hub on 127.0.0.1 for tests and benchmarks of `hf://` reads: dataset
repositories served from a folder the way `huggingface_hub`'s `HfFileSystem` reads them.

Use when: a test or benchmark reads `hf://datasets/<owner>/<name>/...` (through fsspec,
pyarrow or `huggingface_hub` itself) and needs a real server, no mocks in the client: listings,
sizes, sha256 and ETags, ranged reads, 429s with `Retry-After`, request counts, and a file whose
content changes under its name.
Cost: a thread per server and per connection; each file hashed once per change
(`recipes/testing_hub_repos.py`).
Adapt here: `LocalHub`'s switches (`limit_next`, `limit_path`, `retry_after`, `latency`), its
`lfs` hook (which files the Hub keeps in LFS) and `write_file`; the answers themselves are in
`recipes/testing_hub_answers.py`.
Trade-off: it serves what `HfFileSystem` reads (repository info, the tree, paths-info, resolve
with HEAD and one byte range), for dataset repositories at their current revision (`main` or
its commit sha). No history: an older commit answers 404 RevisionNotFound where the Hub would
serve its content. No redirect to a CDN, no Xet, no writes through the API.
`use_hub_endpoint` points `huggingface_hub` at it (its endpoint is read at import).
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from recipes.testing_hub_answers import HubHTTPServer, HubRequest, HubRoute
from recipes.testing_hub_repos import HubFile, HubRepos, is_lfs_default


class LocalHub:
    """A threaded fake Hub on 127.0.0.1 serving the dataset repositories under `root`
    (`root/<owner>/<name>/<path>`; names starting with "." are not served).

    Args:
        root: the folder of repositories.
        latency: seconds slept before every response (first-byte latency).
        retry_after: the `Retry-After` (whole seconds) of a 429.
        lfs: `lfs(path, size)` says whether a file is in LFS: then its listing carries
            `lfs.oid` (sha256) and its resolve `X-Linked-Etag` and `X-Linked-Size`; otherwise
            its `ETag` is git's blob sha1, as on the Hub.
        page_size: tree entries per page (the Hub pages by 1,000 with a `Link` header).

    Switches a test can set at any time: `limit_next = K` (the next K requests answer 429)
    and `limit_path[key] = K` (the next K requests for that key), where a key is
    "<owner>/<name>/<path in repo>" ("<owner>/<name>" for repository info and paths-info).
    Counts: `gets[key]` and `heads[key]` (resolve requests per file, 429s included),
    `throttled[key]` (429s), and `log`, every request as a `HubRequest`.

    Example:
        >>> with LocalHub(tmp_path) as hub, use_hub_endpoint(hub.endpoint):
        ...     HfFileSystem().ls("datasets/owner/name/data")
    """

    def __init__(
        self,
        root: str | Path,
        *,
        latency: float = 0.0,
        retry_after: int = 1,
        lfs: Callable[[str, int], bool] = is_lfs_default,
        page_size: int = 1000,
    ):
        self.root = Path(root)
        self.repos = HubRepos(root, lfs=lfs)
        self.latency = latency
        self.retry_after = retry_after
        self.page_size = page_size
        self.limit_next = 0
        self.limit_path: dict[str, int] = {}
        self.gets: collections.Counter = collections.Counter()
        self.heads: collections.Counter = collections.Counter()
        self.throttled: collections.Counter = collections.Counter()
        self.log: list[HubRequest] = []
        self.lock = threading.Lock()
        self._server = None
        self._thread = None

    def __enter__(self) -> LocalHub:
        self._server = HubHTTPServer(self)
        self._thread = threading.Thread(  # polled every 20 ms: __exit__ waits for the poll
            target=self._server.serve_forever, args=(0.02,), daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        """The URL to use as `HF_ENDPOINT` (or `HfFileSystem(endpoint=...)`)."""
        return f"http://127.0.0.1:{self.port}"

    def write_file(self, repo_id: str, path: str, data: bytes) -> HubFile:
        """Writes or replaces a file: same name, new sha256, ETag and commit."""
        return self.repos.write_file(repo_id, path, data)

    def commit(self, repo_id: str) -> str:
        """The repository's commit sha now (`X-Repo-Commit`, the info's `sha`)."""
        return self.repos.commit(repo_id)

    def take_limit(self, key: str) -> bool:
        """Whether this request (for `key`) answers 429, using up one of the switches' counts."""
        with self.lock:
            if self.limit_next > 0:
                self.limit_next -= 1
                return True
            if self.limit_path.get(key, 0) > 0:
                self.limit_path[key] -= 1
                return True
        return False

    def record(self, request: HubRequest) -> None:
        """Counts an answered request and adds it to the log."""
        with self.lock:
            if request.route is HubRoute.RESOLVE and request.method == "GET":
                self.gets[request.key] += 1
            if request.route is HubRoute.RESOLVE and request.method == "HEAD":
                self.heads[request.key] += 1
            if request.status == 429:
                self.throttled[request.key] += 1
            self.log.append(request)


@contextlib.contextmanager
def use_hub_endpoint(endpoint: str):
    """Points `huggingface_hub` at `endpoint` for the block, here and in the processes it
    starts, and keeps it off the network: `HF_ENDPOINT` is read once, at import, into
    `huggingface_hub.constants.ENDPOINT` and the resolve URL template, so both are set here
    (and the environment, for spawned children); offline mode off, telemetry, the implicit
    token and Xet off. Cached `HfFileSystem` instances are dropped on entry and exit.

    For one file system only, `HfFileSystem(endpoint=endpoint, token=False)` is enough.
    """
    from huggingface_hub import HfFileSystem, constants

    settings = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": True,
        "HF_HUB_DISABLE_XET": True,
    }
    environment = {
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_HUB_DISABLE_XET": "1",
    }
    saved = {name: getattr(constants, name) for name in settings}
    saved_environment = {name: os.environ.get(name) for name in environment}
    for name, value in settings.items():
        setattr(constants, name, value)
    os.environ.update(environment)
    HfFileSystem.clear_instance_cache()
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            setattr(constants, name, value)
        for name, value in saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        HfFileSystem.clear_instance_cache()


@contextlib.contextmanager
def hub_process(root: str | Path, *, latency: float = 0.0):
    """A `LocalHub` of `root` in a process of its own (so that serving takes neither the
    reader's GIL nor its CPU time). Yields its endpoint."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "recipes.testing_hub", str(root), str(latency)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("http://"):
            raise RuntimeError(f"the fake Hub process failed to start (exit code {proc.poll()})")
        yield line
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":  # python -m recipes.testing_hub ROOT LATENCY
    with LocalHub(sys.argv[1], latency=float(sys.argv[2])) as _hub:
        print(_hub.endpoint, flush=True)
        sys.stdin.read()  # until the parent closes it
