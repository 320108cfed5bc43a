"""`ShardOutput`: the folder or bucket a shard set is written to, where each file appears whole
or not at all.

Use when: `write_shards` or `index_shards` publishes a shard or the index (`publish`), removes
the old index before a rewrite (`remove_index`) or the shards an earlier, larger write left
(`remove_stale`).
Cost: a local file is written to a temp file, fsynced and renamed; a remote one is written to a
local temp file, then uploaded in one `put_file` (a single PUT, or a multipart upload that only
its completion makes visible). Opening a local output lists its folder once, to remove the temp
files of writers that were killed.
Adapt here: `SHARD_PATTERN` (what `remove_stale` takes for a shard of ours).
Trade-off: a killed writer leaves no shard a reader could take, but its temp files stay until
the next writer of that folder opens it (and finds their process gone).
Copy with: common/shards/shard_index.py, common/shards/shard_samples.py.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid

from recipes.common.shards.shard_index import INDEX_NAME

SHARD_PATTERN = re.compile(r"shard-\d{6}\.(tar|parquet)$")


class ShardOutput:
    """Files published whole under `url` (a folder or an fsspec URL)."""

    def __init__(self, url: str, storage_options: dict | None):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.local = "file" in _protocols(self.fs)
        self.fs.makedirs(self.root, exist_ok=True)
        if self.local:
            for name in os.listdir(self.root):  # temp files of a killed writer
                if ".tmp-" in name:
                    _remove_if_dead(os.path.join(self.root, name))

    def publish(self, name: str, data: bytes) -> None:
        """`name` appears whole or not at all: a local rename, or one upload (a single PUT, or
        a multipart upload that only its completion makes visible)."""
        final = f"{self.root}/{name}"
        if self.local:
            temp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, final)
            return
        with tempfile.NamedTemporaryFile(prefix="recipes-shard-", suffix=name) as temp:
            temp.write(data)
            temp.flush()
            self.fs.put_file(temp.name, final)

    def remove_index(self) -> None:
        try:
            self.fs.rm_file(f"{self.root}/{INDEX_NAME}")
        except FileNotFoundError:
            pass

    def remove_stale(self, keep: set[str]) -> None:
        """Shards named as ours but not in the index just written (an earlier write had more)."""
        for path in self.fs.ls(self.root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if SHARD_PATTERN.match(name) and name not in keep:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass


def _protocols(fs) -> tuple:
    protocol = fs.protocol
    if isinstance(protocol, tuple):
        return protocol
    return (protocol,)


def _remove_if_dead(path: str) -> None:
    try:
        pid = int(path.rsplit(".tmp-", 1)[1].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, IndexError):
        return
    except ProcessLookupError:
        try:
            os.remove(path)
        except OSError:
            pass
    except PermissionError:
        return
