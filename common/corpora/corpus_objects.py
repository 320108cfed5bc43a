"""The objects of a corpus: which URLs a folder, glob or list names, their format by suffix, and
the version of each (an ETag, a sha256, or a local file's identity) that a plan is keyed by.

Use when: a corpus is given as a folder, a glob or a list of URLs (`list_objects`), and a plan
made earlier must be matched to the object as it is now (`object_version`).
Cost: one listing (`find` or `glob`) per source and one `info()` (a HEAD on S3 and HTTP) per
object.
Adapt here: `SUFFIXES` (the names read, and as what); `VERSION_KEYS` (where your storage puts an
object's checksum in fsspec's `info()`).
Trade-off: a server that gives neither an ETag nor a checksum (a plain HTTP server) leaves an
object without a version: it is planned again on every open, and a change of the same size
between two reads is only noticed if its row groups (Parquet) or line count (JSONL) differ.
Copy with: nothing.
"""

from __future__ import annotations

import glob as globbing
from collections.abc import Sequence
from typing import NamedTuple


class CorpusFormatError(ValueError):
    """An object that does not read as what its name says (a Parquet footer that does not parse,
    a truncated gzip, a line that is not JSON, no text column); the message names the object."""


class CorpusChangedError(RuntimeError):
    """An object that changed on the source since its plan was made (same name, new content):
    read mid-epoch, its rows would not be the plan's. Never retried."""

    transient = False


class ObjectKind(NamedTuple):
    """How an object is read: `format` "parquet" or "jsonl", and its `compression` ("gzip",
    "zstd" or None)."""

    format: str
    compression: str | None


SUFFIXES = (
    (".parquet", ObjectKind("parquet", None)),
    (".jsonl", ObjectKind("jsonl", None)),
    (".ndjson", ObjectKind("jsonl", None)),
    (".jsonl.gz", ObjectKind("jsonl", "gzip")),
    (".ndjson.gz", ObjectKind("jsonl", "gzip")),
    (".jsonl.zst", ObjectKind("jsonl", "zstd")),
    (".ndjson.zst", ObjectKind("jsonl", "zstd")),
)

# fsspec `info()` keys that name an object's content, most specific first: the Hub's LFS sha256
# and git blob id, a checksum, then S3's and HTTP's ETag
VERSION_KEYS = ("sha256", "blob_id", "ETag", "etag", "e_tag")


def object_kind(name: str) -> ObjectKind | None:
    """The kind of the object `name` by its suffix, or None when it is not a corpus file."""
    lower = name.lower()
    for suffix, kind in SUFFIXES:
        if lower.endswith(suffix):
            return kind
    return None


def object_version(info: dict) -> str | None:
    """What identifies an object's content in its fsspec `info()`: the Hub's LFS sha256, a
    checksum or ETag, else a local file's inode, mtime and size; None when none is given."""
    lfs = info.get("lfs")
    if isinstance(lfs, dict) and lfs.get("sha256"):
        return f"sha256:{lfs['sha256']}"
    for key in VERSION_KEYS:
        value = info.get(key)
        if value:
            return f"{key.lower()}:{str(value).strip(chr(34))}:size:{info.get('size')}"
    if info.get("mtime") is not None and info.get("ino") is not None:  # a local file
        return f"local:{info['ino']}:{info['mtime']!r}:size:{info.get('size')}"
    return None


def list_objects(fs, source: str) -> list[str]:
    """The corpus files (by `SUFFIXES`) that `source` names on `fs`, sorted: every one under a
    folder (recursively), those a glob matches, or the file itself.

    Raises:
        FileNotFoundError: nothing readable there; the message says what was searched.
    """
    path = fs._strip_protocol(source)
    protocols = fs.protocol
    if isinstance(protocols, str):
        protocols = (protocols,)
    if "http" in protocols or "https" in protocols:  # no listing: a folder URL is HTML, a file
        found = [path]  # URL is the file (an `isdir` would download it to look for links)
    elif globbing.has_magic(path):
        found = fs.glob(path)
    elif _is_folder(fs, path, source):
        found = fs.find(path)
    else:
        found = [path]
    names = sorted(p for p in found if object_kind(p) is not None)
    if not names:
        suffixes = ", ".join(suffix for suffix, _ in SUFFIXES)
        raise FileNotFoundError(
            f"No corpus files at {source} ({len(found)} objects searched for {suffixes}). Pass a "
            "folder, a glob or the files themselves."
        )
    return names


def _is_folder(fs, path: str, source: str) -> bool:
    """Whether `path` is a folder, from `info()`: a busy server's error (a 429 from the Hub)
    propagates, to be retried, where `isdir` would say "not a folder" (it swallows OSError).

    Raises:
        FileNotFoundError: nothing at `source`.
    """
    try:
        return fs.info(path).get("type") == "directory"
    except FileNotFoundError:
        raise FileNotFoundError(
            f"No corpus files at {source}: nothing is there. Pass a folder, a glob or the files "
            "themselves."
        ) from None


def as_sources(url: str | Sequence[str]) -> list[str]:
    """`url` as a list of sources (a folder, a glob or a file each)."""
    if isinstance(url, str):
        return [url]
    sources = [str(u) for u in url]
    if not sources:
        raise ValueError("`url` is an empty list; pass a folder, a glob, a URL or a list of them.")
    return sources
