"""A shard set as a cache's input: a content hash from its index, and reads checked against it.

Use when: a cache built from a `ShardSet` (tokens, spectrograms) must be keyed on the shards'
content: the index holds each shard's sha256, so the key costs one small JSON read and a cache
is reused or rebuilt before any shard is fetched (issue 27).
Cost: `content_hash`: nothing beyond the index (a shard it gives no sha256 is read and hashed).
`read_checked`: a local shard is hashed once per process and file version before its samples
come (`ShardSet.read`); a remote one is downloaded whole to a temp file and checked the same
way, so every sample a cache stores comes from bytes the index vouches for.
Adapt here: `_download` (e.g. through a `PrefetchCache`).
Trade-off: the key trusts the index: a shard rewritten under an old index is caught when it is
read (`ShardFormatError`), not by the key.
Copy with: common/object_download.py, common/packed_strings.py, common/shard_checks.py,
  common/shard_formats.py, common/shard_samples.py, common/sharded_dataset.py, common/sharding.py,
  common/shards.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator

from recipes.common.shards import ShardSet


def content_hash(shards: ShardSet, *settings: str) -> str:
    """sha256 of the set's format, `settings` (what the reader takes from it: a field name) and
    each shard's sample count and sha256, in order. Names and URLs are left out: a moved or
    copied set keeps its caches."""
    digest = hashlib.sha256(json.dumps({"shard_format": shards.format, "settings": list(settings)}).encode())
    for url, entry in zip(shards.urls, shards.entries, strict=True):
        sha = entry.get("sha256") or _hash(url, shards.storage_options)
        digest.update(f"\n{int(entry['samples'])}\0{sha}".encode())
    return digest.hexdigest()


def read_checked(shards: ShardSet, shard: int, **read_args) -> Iterator[dict]:
    """`shards.read(shard, **read_args)`, from bytes checked against the index (size, sha256).

    Raises:
        ShardFormatError: the shard differs from its index, or yields fewer samples than it says.
    """
    url = shards.urls[shard]
    if "://" not in url or url.startswith("file://"):
        yield from shards.read(shard, **read_args)  # checks a local file itself
        return
    with tempfile.NamedTemporaryFile(prefix="recipes-shard-", suffix="." + shards.format) as temp:
        _download(url, temp, shards.storage_options)
        yield from shards.read(shard, path=temp.name, **read_args)


def _download(url: str, out, storage_options: dict | None) -> None:
    import fsspec

    with fsspec.open(url, "rb", **(storage_options or {})) as source:
        shutil.copyfileobj(source, out, 1 << 22)
    out.flush()


def _hash(url: str, storage_options: dict | None) -> str:
    import fsspec

    digest = hashlib.sha256()
    with fsspec.open(url, "rb", **(storage_options or {})) as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()
