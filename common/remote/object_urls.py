"""Which remote URLs a cache takes, and the local name each gets.

Use when: a URL comes from a user or an index before it is fetched (`check_url` refuses `pipe:`
commands, chained `a::b` URLs and protocols outside `ALLOWED`), or a cache names its local copy
(`cache_key`: a hash of the URL).
Cost: one regular expression per URL, memoised.
Adapt here: `ALLOWED`, the protocols your storage uses.
Trade-off: an allow-list, not a deny-list: a new fsspec protocol needs adding here.
Copy with: nothing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from typing import NamedTuple

# "hf": huggingface_hub's file system (hf://datasets/<owner>/<name>/...), issue 49.
ALLOWED = {"file", "local", "http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hf"}


@functools.lru_cache(maxsize=65536)
def cache_key(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:40]


@functools.lru_cache(maxsize=65536)
def check_url(url: str) -> None:
    """Refuses `pipe:` commands, chained URLs and protocols outside the allow-list."""
    if "::" in url:
        raise ValueError(f"Refusing chained URL {url!r}; pass the plain remote URL.")
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*):", url)
    if match and len(match.group(1)) > 1:  # one letter is a Windows drive
        protocol = match.group(1).lower()
        if protocol not in ALLOWED:
            raise ValueError(
                f"Refusing {url!r}: protocol {protocol!r} is not one of {sorted(ALLOWED)}."
            )


class OpenedKey(NamedTuple):
    """Which process opened a filesystem, for which protocol: a forked child opens its own."""

    pid: int
    protocol: str


def open_filesystem(url: str, storage_options: dict, pool: int, opened: dict):
    """(filesystem, path) for `url`: one fsspec filesystem per process and protocol, kept in
    `opened`; an S3 client's connection pool sized to `pool` (botocore's 10 would queue ranges)."""
    import fsspec

    protocol = fsspec.utils.get_protocol(url)
    key = OpenedKey(os.getpid(), protocol)
    fs = opened.get(key)
    if fs is None:
        options = dict(storage_options)
        if protocol in ("s3", "s3a"):
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("max_pool_connections", pool)
            options["config_kwargs"] = config
        fs, _ = fsspec.core.url_to_fs(url, **options)
        opened[key] = fs
    return fs, fs._strip_protocol(url)
