"""What the Hugging Face Hub says about a folder of dataset repositories, for the fake Hub
(`recipes/testing_hub.py`): paths, sizes, sha256, git object ids, LFS pointers, tree entries
and commits, computed from the files as they are now.

Use when: the fake Hub answers a request, or a test needs the sha256, ETag or commit the Hub
would give for a file (`HubRepos.file`, `HubRepos.commit`).
Cost: each file is hashed (sha256 and git sha1) once per change of its size, mtime or inode,
by the first call that needs it; listings walk the repository's folder.
Adapt here: `is_lfs_default` (which files the Hub keeps in LFS), or pass `lfs=`.
Trade-off: one revision, the folder's present state: the commit is a hash of the paths and
contents, not a git history.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# What a new dataset repository's .gitattributes sends to LFS (a subset), and the Hub's size
# from which any file goes to LFS.
LFS_SUFFIXES = frozenset(
    ".arrow .bin .bz2 .gz .lz4 .npy .npz .parquet .pt .safetensors .tar .tgz .xz .zip .zst".split()
)
LFS_MIN_SIZE = 10 * 2**20


def is_lfs_default(path: str, size: int) -> bool:
    """Whether the Hub stores `path` (in its repository) of `size` bytes in LFS by default."""
    return Path(path).suffix in LFS_SUFFIXES or size >= LFS_MIN_SIZE


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
        """The file as the tree and paths-info endpoints list it."""
        entry = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return entry


def describe_file(full: Path, path: str, lfs: bool) -> HubFile:
    """Hashes the file at `full` (`path` in its repository) as the Hub would: sha256 and git's
    blob sha1, of the LFS pointer when `lfs`."""
    size = full.stat().st_size
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


class HubRepos:
    """The dataset repositories under `root` (`root/<owner>/<name>/<path>`; names starting
    with "." are left out), described as the Hub would, hashes cached per file.

    Args:
        root: the folder of repositories.
        lfs: `lfs(path, size)` says whether the Hub keeps a file in LFS.
    """

    def __init__(self, root: str | Path, *, lfs: Callable[[str, int], bool] = is_lfs_default):
        self.root = Path(root)
        self.lfs = lfs
        self._lock = threading.Lock()
        self._hashes: dict[Path, tuple[tuple, HubFile]] = {}

    def exists(self, repo_id: str) -> bool:
        folder = self.root / repo_id
        return repo_id.count("/") == 1 and not repo_id.startswith(".") and folder.is_dir()

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
        with self._lock:
            cached = self._hashes.get(full)
        if cached is not None and cached[0] == signature:
            return cached[1]
        described = describe_file(full, path, self.lfs(path, stat.st_size))
        with self._lock:
            self._hashes[full] = (signature, described)
        return described

    def commit(self, repo_id: str) -> str:
        """The repository's commit sha: a hash of its paths and contents, so that any change
        of a file makes a new commit."""
        digest = hashlib.sha1()
        for path in self.paths(repo_id):
            digest.update(f"{path} {self.file(repo_id, path).sha256}\n".encode())
        return digest.hexdigest()

    def entries(self, repo_id: str, folder: str, *, recursive: bool) -> list[dict] | None:
        """The tree entries below `folder` (its children, or all below it when `recursive`),
        folders first; None when `folder` is not a folder of the repository."""
        prefix = f"{folder}/" if folder else ""
        below = [path for path in self.paths(repo_id) if path.startswith(prefix)]
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
                files.append(self.file(repo_id, path).tree_entry())
        return [self.folder_entry(repo_id, path) for path in sorted(folders)] + files

    def folder_entry(self, repo_id: str, folder: str) -> dict:
        """A folder as the tree lists it; its oid is a hash of what it holds."""
        digest = hashlib.sha1()
        for path in self.paths(repo_id):
            if path.startswith(f"{folder}/"):
                digest.update(f"{path} {self.file(repo_id, path).git_oid}\n".encode())
        return {"type": "directory", "oid": digest.hexdigest(), "size": 0, "path": folder}

    def write_file(self, repo_id: str, path: str, data: bytes) -> HubFile:
        """Writes (or replaces, atomically) a file of a repository: same name, new content,
        so a new sha256, ETag and repository commit. Returns its new description."""
        target = self.root / repo_id / path
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temp.write_bytes(data)
        os.replace(temp, target)
        return self.file(repo_id, path)
