"""The fake Hub's HTTP side (`recipes/testing_hub.py`): the routes `huggingface_hub`'s file
system asks, and a request handler that answers them from a `HubRepos`, as the Hub does.

Use when: `LocalHub` serves; read it to see which endpoints, fields and headers the fake Hub
gives (and so which ones a reader of `hf://` may rely on).
Cost: a thread per connection (keep-alive HTTP/1.1); a resolve reads only its byte range.
Adapt here: a new route is a `HubRoute` member, a pattern in `_ROUTES` and an `_answer_*`.
Trade-off: one byte range per request, no redirects, no compression.

The handler reads its server's `hub` (a `LocalHub`) through a small interface: `repos` (the
`HubRepos`), `latency`, `retry_after`, `page_size`, `take_limit(key)` (whether to answer 429)
and `record(request)` (counts and the log).
"""

from __future__ import annotations

import enum
import http.server
import json
import re
import time
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit


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


class HubHTTPServer(http.server.ThreadingHTTPServer):
    """The stdlib server on a free port of 127.0.0.1, holding the `LocalHub` (`hub`) its
    handlers answer for."""

    daemon_threads = True

    def __init__(self, hub):
        self.hub = hub
        super().__init__(("127.0.0.1", 0), HubHandler)


class HubHandler(http.server.BaseHTTPRequestHandler):
    """Answers one request for `LocalHub`: routes it, counts it, answers 429 when a switch
    says so, else answers from the repository's folder (one `_answer_*` method per route)."""

    server: HubHTTPServer
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
        arrived = time.monotonic()
        self._asked = None  # what `_start` records, once the request is routed
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
        self._asked = HubRequest(arrived, method, route, key, 0)
        time.sleep(hub.latency)
        try:
            self._answer(route, method, key, unquote(parts["rev"]), url.query, body)
        except Exception as error:  # a bug here answers 500, never a dropped connection
            self._error(500, "", f"{type(error).__name__}: {error}")

    def _answer(self, route, method, key, revision, query, body) -> int:
        hub = self.server.hub
        owner, name, *rest = key.split("/", 2)
        repo_id = f"{owner}/{name}"
        path = "".join(rest)
        if hub.take_limit(key):
            return self._error(429, "", "Rate limited", {"Retry-After": str(hub.retry_after)})
        if not hub.repos.exists(repo_id):
            return self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
        commit = hub.repos.commit(repo_id)
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
        files = [{"rfilename": path} for path in self.server.hub.repos.paths(repo_id)]
        info = {"id": repo_id, "author": repo_id.split("/")[0], "sha": commit, "private": False}
        return self._json({**info, "siblings": files})

    def _answer_tree(self, repo_id: str, folder: str, query: dict) -> int:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries = self.server.hub.repos.entries(repo_id, folder, recursive=recursive)
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
        repos = self.server.hub.repos
        found = []
        for asked in form.get("paths", []):
            asked = asked.strip("/")
            if (repos.root / repo_id / asked).is_file():
                found.append(repos.file(repo_id, asked).tree_entry())
            elif asked and repos.entries(repo_id, asked, recursive=False) is not None:
                found.append(repos.folder_entry(repo_id, asked))
        return self._json(found)

    def _answer_resolve(self, method: str, repo_id: str, path: str, commit: str) -> int:
        repos = self.server.hub.repos
        if path not in repos.paths(repo_id):
            return self._error(404, "EntryNotFound", f"{path} does not exist on main")
        described = repos.file(repo_id, path)
        headers = {"ETag": f'"{described.etag}"', "X-Repo-Commit": commit}
        headers["Accept-Ranges"] = "bytes"
        if described.lfs:
            headers["X-Linked-Etag"] = f'"{described.sha256}"'
            headers["X-Linked-Size"] = str(described.size)
        start, stop = 0, described.size
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            span = byte_range(wanted, described.size)
            if span is None:
                headers["Content-Range"] = f"bytes */{described.size}"
                return self._error(416, "", f"Range not satisfiable: {wanted}", headers)
            start, stop = span
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{described.size}"
        self._start(status, stop - start, headers)
        if method == "GET":
            with open(repos.root / repo_id / path, "rb") as f:
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
        """Records the request with its status (before the client can read the answer, so
        that a test sees the count once its call returns), then sends the status line."""
        if self._asked is not None:
            self.server.hub.record(self._asked._replace(status=status))
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


def byte_range(header: str, size: int) -> tuple[int, int] | None:
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
