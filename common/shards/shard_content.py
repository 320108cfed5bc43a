"""A shard set as a cache's input: a content hash from its index, and reads checked against it.

Use when: a cache built from a `ShardSet` (tokens, spectrograms) must be keyed on the shards'
content: the index holds each shard's sha256, so the key costs one small JSON read and a cache
is reused or rebuilt before any shard is fetched (issue 27). `listed_shard`: a shard file named
alone (a path, a glob's match) is still read through its set's index, never as a plain file.
Cost: `listed_shard`: one existence check (and index read) per folder.
`content_hash`: nothing beyond the index (a shard it gives no sha256 is read and hashed).
`read_checked`: a local shard is hashed once per process and file version before its samples
come (`ShardSet.read`); a remote one is downloaded whole to a temp file and checked the same
way, so every sample a cache stores comes from bytes the index vouches for.
Adapt here: `_download` (e.g. through a `PrefetchCache`).
Trade-off: the key trusts the index: a shard rewritten under an old index is caught when it is
read (`ShardFormatError`), not by the key.
Copy with: common/caches/cache_folder.py, common/caches/packed_strings.py,
  common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_formats.py, common/shards/shard_index.py, common/shards/shard_samples.py,
  common/shards/shard_set.py, common/shards/sharded_dataset.py, common/shards/tar_members.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator

from recipes.common.shards.shard_index import FORMAT, INDEX_NAME, VERSION
from recipes.common.shards.shard_set import ShardSet


def content_hash(shards: ShardSet, *settings: str) -> str:
    """sha256 of the set's format, `settings` (what the reader takes from it: a field name) and
    each shard's sample count and sha256, in order. Names and URLs are left out: a moved or
    copied set keeps its caches."""
    digest = hashlib.sha256(
        json.dumps({"shard_format": shards.format, "settings": list(settings)}).encode()
    )
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


def listed_shard(path: str, sets: dict) -> ShardSet | None:
    """The one-shard `ShardSet` of the file `path` when it sits beside the index of a shard set that
    lists it (so that its samples are checked against the index, never read as a plain file);
    None for another file. `sets` holds each folder's set (or None) between calls.

    Raises:
        ShardIndexError: the index beside it is ours (or no JSON) but damaged.
    """
    folder = "."
    name = path
    if "/" in path:
        folder, name = path.rstrip("/").rsplit("/", 1)
    if not name.endswith((".tar", ".parquet")):
        return None
    if folder not in sets:
        sets[folder] = _set_in(folder)
    shards = sets[folder]
    if shards is None:
        return None
    entry = next((e for e in shards.entries if e["name"] == name), None)
    if entry is None:
        return None
    version = VERSION
    if shards.checksums is None:  # a v1 index
        version = 1
    index = {
        "format": FORMAT,
        "version": version,
        "shard_format": shards.format,
        "columns": shards.columns,
        "samples": entry["samples"],
        "shards": [entry],
    }
    return ShardSet(shards.url, index, shards.storage_options)


def _set_in(folder: str) -> ShardSet | None:
    """The shard set whose index is in `folder`; None where there is no index, or another tool's."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(folder)
    try:
        index = json.loads(fs.cat_file(f"{root.rstrip('/')}/{INDEX_NAME}"))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError):  # not JSON: ours damaged, or another's; `open` says so
        index = {"format": FORMAT}
    if not isinstance(index, dict) or (index.get("format") != FORMAT and "shards" not in index):
        return None
    return ShardSet.open(folder)
