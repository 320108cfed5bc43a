"""How a cache folder is built: under a temp name beside its target, by one process or split
over the ranks of a `torch.distributed` group, then renamed into place.

Use when: a `build_*` step writes a cache that workers, other ranks or a rerun after a crash
will read (`FolderBuild`), or sweeps the temp files builders killed midway left behind
(`sweep_dead_temps`).
Cost: one fsync per file and per folder; a barrier per build across ranks.
Adapt here: nothing; each cache passes its own format name, error type and rebuild hint.
Trade-off: rank 0 publishes after a barrier; a build across nodes needs a folder every rank
can write (a shared file system). Temp names hold the host and pid, so only a dead builder's
temps on this host are swept.
Copy with: common/caches/cache_files.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from recipes.common.caches.cache_files import _host, _seal, replace_dir, write_synced
from recipes.common.workers.process_lifetime import pid_alive


def sweep_dead_temps(folder: Path, name: str) -> int:
    """Removes temp folders and files of `name` (`.{name}.{host}.{pid}.*.tmp`; `name` may be a
    glob pattern, e.g. `eval-*`) whose builder on this host is dead; returns how many. Temps of
    other hosts (a shared file system) are left alone."""
    removed, host = 0, _host()
    for tmp in Path(folder).glob(f".{name}.*.tmp"):
        parts = tmp.name.split(".")  # the host has no dots (`_host`); a name may have some
        owner = next((int(parts[i + 1]) for i in range(len(parts) - 1)
                      if parts[i] == host and parts[i + 1].isdigit()), None)
        if owner is not None and not pid_alive(owner):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed += 1
    return removed


class FolderBuild:
    """Builds a cache folder atomically, in one process or split over the ranks of a group.

    Every rank enters the same `with` block; rank 0 makes the temp folder next to `target`
    (after sweeping dead builders' temps) and every rank writes its part files into `path`.
    `publish(header)` waits for all ranks, then rank 0 writes `header.json` and renames the
    folder into place. An exception, or a rank that dies (the collectives fail), leaves
    nothing published; rank 0 removes the temp folder, or a later build sweeps it.

    Args:
        target: the cache folder.
        distributed: split over the initialised `torch.distributed` group (every rank calls).

    Example:
        >>> build = FolderBuild(cache_dir, distributed=True)
        >>> if build.needed(lambda: MyCache.open(cache_dir, fingerprint=fp), MyCacheError):
        ...     with build:
        ...         for i in build.block(n):
        ...             write_item(i, build.part("data.bin"))  # yours: append item i's bytes
        ...         build.concat("data.bin")
        ...         build.publish({"format": "my-cache", "version": 1, "fingerprint": fp})
    """

    def __init__(self, target: str | os.PathLike, *, distributed: bool = False):
        self.target = Path(target)
        self.rank, self.world = _rank_and_world() if distributed else (0, 1)
        self.path: Path | None = None
        self._published = False
        self._open_cache: Callable[[], object] | None = None
        self._error: type[Exception] = Exception

    def _valid(self) -> bool:
        """Whether `target` opens as a valid cache now (another process published it first)."""
        if self._open_cache is None:
            return False
        try:
            self._open_cache()
        except self._error:
            return False
        return True

    def needed(self, open_cache: Callable[[], object], error: type[Exception]) -> bool:
        """Whether to build: rank 0 tries `open_cache()`, which raises `error` for a missing,
        stale or damaged cache, and every rank gets the answer. Rank 0 first removes the temp
        folders of this cache's dead builders (a build killed midway)."""
        answer = None
        self._open_cache, self._error = open_cache, error
        if self.rank == 0:
            if self.target.parent.is_dir():  # a build killed midway, even when no build follows
                sweep_dead_temps(self.target.parent, self.target.name)
            try:
                open_cache()
                answer = False
            except error:
                answer = True
        return self._from_rank_0(answer)

    def __enter__(self) -> FolderBuild:
        where = None
        if self.rank == 0:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            sweep_dead_temps(self.target.parent, self.target.name)
            where = tempfile.mkdtemp(prefix=f".{self.target.name}.{_host()}.{os.getpid()}.", suffix=".tmp",
                                     dir=self.target.parent)
        self.path = Path(self._from_rank_0(where))
        return self

    def __exit__(self, *exc) -> None:
        if self.rank == 0 and not self._published and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def block(self, n: int) -> range:
        """This rank's contiguous share of `range(n)` (rank order is index order)."""
        return range(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def part(self, name: str, rank: int | None = None) -> Path:
        return self.path / f"{name}.part{self.rank if rank is None else rank}"

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, value) -> list:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def concat(self, name: str) -> None:
        """Rank 0 joins every rank's `part(name)` into `name`, in rank order (after a barrier)."""
        self.barrier()
        if self.rank != 0:
            return
        target = self.path / name
        os.replace(self.part(name, 0), target)
        with open(target, "ab") as out:
            for rank in range(1, self.world):
                with open(self.part(name, rank), "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 24)
                self.part(name, rank).unlink()
            out.flush()
            os.fsync(out.fileno())

    def publish(self, header: dict | None) -> None:
        """After every rank is done: rank 0 writes its `header` to `header.json` and renames the
        folder into place (the other ranks' `header` is ignored). When another process has
        published a valid copy meanwhile (the `open_cache` of `needed` opens it), that copy
        stays and this build is deleted: the first to publish wins."""
        self.barrier()
        if self.rank == 0:
            header = {**header, "header_sha256": _seal(header)}
            write_synced(self.path / "header.json", json.dumps(header, indent=1).encode("utf-8"))
            replace_dir(self.path, self.target, keep=self._valid)
        self._published = True
        self.barrier()  # no rank reads the cache before it is in place

    def _from_rank_0(self, value):
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
