"""A fake Hugging Face Hub on 127.0.0.1 for tests and benchmarks of `hf://` reads: dataset
repositories served from a folder the way `huggingface_hub`'s `HfFileSystem` reads them.

Use when: a test or benchmark reads `hf://datasets/<owner>/<name>/...` (through fsspec,
pyarrow or `huggingface_hub` itself) and needs a real server, no mocks in the client: listings,
sizes, sha256 and ETags, ranged reads, 429s with `Retry-After`, request counts, and a file whose
content changes under its name.
Cost: a thread per server and per connection; each file is hashed (sha256 and git sha1) once
per change of its size, mtime or inode, by the first request that needs it.
Adapt here: `LocalHub`'s switches (`limit_next`, `limit_path`, `retry_after`, `latency`), its
`lfs` hook (which files the Hub would store in LFS) and `write_file`.
Trade-off: it serves what `HfFileSystem` reads (repository info, the tree, paths-info, resolve
with HEAD and one byte range), for dataset repositories at their current revision (`main` or
its commit sha). No history: an older commit answers 404 RevisionNotFound where the Hub would
serve its content. No redirect to a CDN, no Xet, no writes through the API.
`use_hub_endpoint` points `huggingface_hub` at it (its endpoint is read at import).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

# What a new dataset repository's .gitattributes sends to LFS (a subset), and the Hub's size
# above which any file goes to LFS.
LFS_SUFFIXES = frozenset(
    ".arrow .bin .bz2 .gz .lz4 .npy .npz .parquet .pt .safetensors .tar .tgz .xz .zip .zst".split()
)
LFS_MIN_SIZE = 10 * 2**20


def is_lfs_default(path: str, size: int) -> bool:
    """Whether the Hub stores `path` (in its repository) of `size` bytes in LFS by default."""
    return Path(path).suffix in LFS_SUFFIXES or size >= LFS_MIN_SIZE


class HubRoute(enum.Enum):
    """The endpoints of the Hub that `HfFileSystem` reads."""

    INFO = "info"
    """GET /api/datasets/<owner>/<name>[/revision/<rev>]: the repository's id, commit, files."""
    TREE = "tree"
    """GET /api/datasets/<owner>/<name>/tree/<rev>[/<path>]: a folder's entries (recursive=)."""
    PATHS_INFO = "paths-info"
    """POST /api/datasets/<owner>/<name>/paths-info/<rev>: the entries of the paths asked for."""
    RESOLVE = "resolve"
    """HEAD or GET /datasets/<owner>/<name>/resolve/<rev>/<path>: a file, whole or one range."""


_REPO = r"/(?P<owner>[^/]+)/(?P<name>[^/]+)"
_ROUTES = (
    (HubRoute.INFO, re.compile(rf"/api/datasets{_REPO}(?:/revision/(?P<rev>[^/]+))?")),
    (HubRoute.TREE, re.compile(rf"/api/datasets{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")),
    (HubRoute.PATHS_INFO, re.compile(rf"/api/datasets{_REPO}/paths-info/(?P<rev>[^/]+)")),
    (HubRoute.RESOLVE, re.compile(rf"/datasets{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")),
)


class HubRequest(NamedTuple):
    """One request as the fake Hub answered it (`LocalHub.log`)."""

    at: float  # time.monotonic() when it arrived
    method: str
    route: HubRoute
    key: str  # "<owner>/<name>/<path in repo>" ("<owner>/<name>" for the repository)
    status: int


class HubFile(NamedTuple):
    """A file of a repository as the Hub describes it."""

    path: str  # in the repository, with "/"
    size: int
    sha256: str
    git_oid: str  # git's blob sha1 (of the LFS pointer for an LFS file)
    lfs: bool
    pointer_size: int  # bytes of the LFS pointer file (0 when not in LFS)

    @property
    def etag(self) -> str:
        """What the Hub sends as `ETag` (and `X-Linked-Etag` for LFS): sha256 or git sha1."""
        return self.sha256 if self.lfs else self.git_oid

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return entry


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
    and `limit_path[key] = K` (the next K requests for that key). Counts: `gets[key]` and
    `heads[key]` (resolve requests per file, 429s included), `throttled[key]` (429s), and
    `log`, every request as a `HubRequest`.

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
        self.latency = latency
        self.retry_after = retry_after
        self.lfs = lfs
        self.page_size = page_size
        self.limit_next = 0
        self.limit_path: dict[str, int] = {}
        self.gets: collections.Counter = collections.Counter()
        self.heads: collections.Counter = collections.Counter()
        self.throttled: collections.Counter = collections.Counter()
        self.log: list[HubRequest] = []
        self.lock = threading.Lock()
        self._hashes: dict[Path, tuple[tuple, HubFile]] = {}
        self._server = None
        self._thread = None

    def __enter__(self) -> LocalHub:
        self._server = _HubHTTPServer(self)
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
        """Writes (or replaces, atomically) a file of a repository: same name, new content,
        so a new sha256, ETag and repository commit. Returns its new description."""
        target = self.root / repo_id / path
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temp.write_bytes(data)
        os.replace(temp, target)
        return self.file(repo_id, path)

    def repo_dir(self, repo_id: str) -> Path | None:
        folder = self.root / repo_id
        if repo_id.count("/") != 1 or repo_id.startswith(".") or not folder.is_dir():
            return None
        return folder

    def paths(self, repo_id: str) -> list[str]:
        """The files of a repository, sorted, as paths in it."""
        folder = self.root / repo_id
        found = []
        for path in folder.rglob("*"):
            rel = path.relative_to(folder)
            if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                found.append(rel.as_posix())
        return sorted(found)

    def file(self, repo_id: str, path: str) -> HubFile:
        """A file's description, hashed again only when its size, mtime or inode changed."""
        full = self.root / repo_id / path
        stat = full.stat()
        signature = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        with self.lock:
            cached = self._hashes.get(full)
        if cached is not None and cached[0] == signature:
            return cached[1]
        described = _describe(full, path, stat.st_size, self.lfs(path, stat.st_size))
        with self.lock:
            self._hashes[full] = (signature, described)
        return described

    def commit(self, repo_id: str) -> str:
        """The repository's commit sha: a hash of its paths and contents, so any change of a
        file makes a new commit."""
        digest = hashlib.sha1()
        for path in self.paths(repo_id):
            digest.update(f"{path} {self.file(repo_id, path).sha256}\n".encode())
        return digest.hexdigest()

    def _take_limit(self, key: str) -> bool:
        """Whether this request (for `key`) answers 429, using up one of the switches' counts."""
        with self.lock:
            if self.limit_next > 0:
                self.limit_next -= 1
                return True
            if self.limit_path.get(key, 0) > 0:
                self.limit_path[key] -= 1
                return True
        return False


def _describe(full: Path, path: str, size: int, lfs: bool) -> HubFile:
    sha256 = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size)
    with open(full, "rb") as f:
        while block := f.read(1 << 20):
            sha256.update(block)
            git.update(block)
    if not lfs:
        return HubFile(path, size, sha256.hexdigest(), git.hexdigest(), False, 0)
    pointer = (
        "version https://git-lfs.github.com/spec/v1\n"
        f"oid sha256:{sha256.hexdigest()}\nsize {size}\n"
    ).encode()
    pointer_oid = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
    return HubFile(path, size, sha256.hexdigest(), pointer_oid, True, len(pointer))


class _HubHTTPServer(http.server.ThreadingHTTPServer):
    """The stdlib server on a free port of 127.0.0.1, holding the `LocalHub` (`hub`)."""

    daemon_threads = True

    def __init__(self, hub: LocalHub):
        self.hub = hub
        super().__init__(("127.0.0.1", 0), HubHandler)


class HubHandler(http.server.BaseHTTPRequestHandler):
    """Answers one request for `LocalHub`: routes it, counts it, answers 429 when a switch
    says so, else answers from the repository's folder (one `_answer_*` method per route)."""

    server: _HubHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects
    disable_nagle_algorithm = True  # headers and body go in two writes: no 40 ms delayed ACK

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        body = b""
        if method == "POST":
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        for route, pattern in _ROUTES:
            match = pattern.fullmatch(url.path)
            if match and (method == "POST") == (route is HubRoute.PATHS_INFO):
                break
        else:
            self._error(404, "", f"No such endpoint: {method} {url.path}")
            return
        parts = {"rev": "", "path": "", **match.groupdict("")}
        path = unquote(parts["path"]).strip("/")
        key = f"{parts['owner']}/{parts['name']}/{path}".rstrip("/")
        with hub.lock:
            if route is HubRoute.RESOLVE:
                counter = hub.gets if method == "GET" else hub.heads
                counter[key] += 1
        time.sleep(hub.latency)
        try:
            status = self._answer(route, method, key, unquote(parts["rev"]), url.query, body)
        except Exception as error:  # a bug here answers 500, never a dropped connection
            status = self._error(500, "", f"{type(error).__name__}: {error}")
        with hub.lock:
            hub.log.append(HubRequest(time.monotonic(), method, route, key, status))

    def _answer(self, route, method, key, revision, query, body) -> int:
        hub = self.server.hub
        owner, name, *rest = key.split("/", 2)
        repo_id = f"{owner}/{name}"
        path = "".join(rest)
        if hub._take_limit(key):
            with hub.lock:
                hub.throttled[key] += 1
            return self._error(429, "", "Rate limited", {"Retry-After": str(hub.retry_after)})
        if hub.repo_dir(repo_id) is None:
            return self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
        commit = hub.commit(repo_id)
        if revision not in ("", "main", commit):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if route is HubRoute.INFO:
            return self._answer_info(repo_id, commit)
        if route is HubRoute.TREE:
            return self._answer_tree(repo_id, path, parse_qs(query))
        if route is HubRoute.PATHS_INFO:
            return self._answer_paths_info(repo_id, parse_qs(body.decode()))
        return self._answer_resolve(method, repo_id, path, commit)

    def _answer_info(self, repo_id: str, commit: str) -> int:
        files = [{"rfilename": path} for path in self.server.hub.paths(repo_id)]
        info = {"id": repo_id, "author": repo_id.split("/")[0], "sha": commit, "private": False}
        return self._json({**info, "siblings": files})

    def _answer_tree(self, repo_id: str, folder: str, query: dict) -> int:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries = _entries(self.server.hub, repo_id, folder, recursive=recursive)
        if entries is None:
            return self._error(404, "EntryNotFound", f"{folder} does not exist on main")
        start = int(query.get("cursor", ["0"])[0])
        stop = start + self.server.hub.page_size
        headers = {}
        if stop < len(entries):  # cursor pagination, as GitHub's and the Hub's Link header
            location = f"http://{self.headers['Host']}{urlsplit(self.path).path}"
            link = f"{location}?recursive={str(recursive).lower()}&cursor={stop}"
            headers["Link"] = f'<{link}>; rel="next"'
        return self._json(entries[start:stop], headers)

    def _answer_paths_info(self, repo_id: str, form: dict) -> int:
        hub = self.server.hub
        found = []
        for asked in form.get("paths", []):
            asked = asked.strip("/")
            if (hub.root / repo_id / asked).is_file():
                found.append(hub.file(repo_id, asked).tree_entry())
            elif asked and _entries(hub, repo_id, asked, recursive=False) is not None:
                found.append(_folder_entry(hub, repo_id, asked))
        return self._json(found)

    def _answer_resolve(self, method: str, repo_id: str, path: str, commit: str) -> int:
        hub = self.server.hub
        if path not in hub.paths(repo_id):
            return self._error(404, "EntryNotFound", f"{path} does not exist on main")
        described = hub.file(repo_id, path)
        headers = {"ETag": f'"{described.etag}"', "X-Repo-Commit": commit}
        headers["Accept-Ranges"] = "bytes"
        if described.lfs:
            headers["X-Linked-Etag"] = f'"{described.sha256}"'
            headers["X-Linked-Size"] = str(described.size)
        start, stop = 0, described.size
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            span = _byte_range(wanted, described.size)
            if span is None:
                headers["Content-Range"] = f"bytes */{described.size}"
                return self._error(416, "", f"Range not satisfiable: {wanted}", headers)
            start, stop = span
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{described.size}"
        self._start(status, stop - start, headers)
        if method == "GET":
            with open(hub.root / repo_id / path, "rb") as f:
                f.seek(start)
                self._write(f.read(stop - start))
        return status

    def _json(self, payload, headers: dict | None = None) -> int:
        body = json.dumps(payload).encode()
        self._start(200, len(body), {"Content-Type": "application/json", **(headers or {})})
        self._write(body)
        return 200

    def _error(self, status: int, code: str, message: str, headers: dict | None = None) -> int:
        """An error as the Hub sends it: `X-Error-Code` (which huggingface_hub maps to
        RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) and a JSON body."""
        body = json.dumps({"error": message}).encode()
        extra = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            extra["X-Error-Code"] = code
        self._start(status, len(body), {**extra, **(headers or {})})
        self._write(body)
        return status

    def _start(self, status: int, length: int, headers: dict) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _write(self, body: bytes) -> None:
        if self.command == "HEAD":
            return
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _entries(hub: LocalHub, repo_id: str, folder: str, *, recursive: bool) -> list[dict] | None:
    """The tree entries below `folder` (its children, or all below it when `recursive`),
    folders first as on the Hub; None when `folder` is not a folder of the repository."""
    prefix = f"{folder}/" if folder else ""
    below = [path for path in hub.paths(repo_id) if path.startswith(prefix)]
    if folder and not below:
        return None
    folders = set()
    files = []
    for path in below:
        parts = path[len(prefix) :].split("/")
        for depth in range(1, len(parts)):
            if recursive or depth == 1:
                folders.add(prefix + "/".join(parts[:depth]))
        if recursive or len(parts) == 1:
            files.append(hub.file(repo_id, path).tree_entry())
    return [_folder_entry(hub, repo_id, path) for path in sorted(folders)] + files


def _folder_entry(hub: LocalHub, repo_id: str, folder: str) -> dict:
    digest = hashlib.sha1()
    for path in hub.paths(repo_id):
        if path.startswith(f"{folder}/"):
            digest.update(f"{path} {hub.file(repo_id, path).git_oid}\n".encode())
    return {"type": "directory", "oid": digest.hexdigest(), "size": 0, "path": folder}


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """[start, stop) of a one-range `Range` header ("bytes=A-B", "bytes=A-", "bytes=-N"),
    or None when it is not satisfiable."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if not first:  # the last N bytes
        return max(0, size - int(last)), size
    start = int(first)
    stop = size
    if last:
        stop = min(int(last) + 1, size)
    if start >= size or stop <= start:
        return None
    return start, stop


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
