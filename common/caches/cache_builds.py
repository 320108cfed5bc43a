"""How a cache folder is built: under a temp name beside its target, by one process or split
over the ranks of a `torch.distributed` group, then renamed into place on every node.

Use when: a `build_*` step writes a cache that workers, other ranks or a rerun after a crash
will read (`FolderBuild`), or sweeps the temp files builders killed midway left behind
(`sweep_dead_temps`).
Cost: one fsync per file and per folder; a few collectives per build across ranks; across
folders that are not shared (node-local disks), the transfer of the parts written elsewhere
(`build_ranks.py`).
Adapt here: nothing; each cache passes its own format name, error type and rebuild hint.
Trade-off: every folder ends with the whole cache (each node's disk holds all of it). A folder
that lacks a valid cache while another folder of the job holds one gets a copy of it over the
process group, with nothing rebuilt. Temp names hold the host and pid, so only a dead
builder's temps on this host are swept.
Copy with: common/caches/build_ranks.py, common/caches/cache_files.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from recipes.common.caches.build_ranks import BuildRanks, distributed_build
from recipes.common.caches.cache_files import _host, _seal, replace_dir, write_synced
from recipes.common.workers.process_lifetime import pid_alive


def sweep_dead_temps(folder: Path, name: str) -> int:
    """Removes temp folders and files of `name` (`.{name}.{host}.{pid}.*.tmp`; `name` may be a
    glob pattern, e.g. `eval-*`) whose builder on this host is dead; returns how many. Temps of
    other hosts (a shared file system) are left alone."""
    removed = 0
    host = _host()
    for tmp in Path(folder).glob(f".{name}.*.tmp"):
        parts = tmp.name.split(".")  # the host has no dots (`_host`); a name may have some
        owner = next(
            (
                int(parts[i + 1])
                for i in range(len(parts) - 1)
                if parts[i] == host and parts[i + 1].isdigit()
            ),
            None,
        )
        if owner is not None and not pid_alive(owner):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed += 1
    return removed


class FolderBuild:
    """Builds a cache folder atomically, in one process or split over the ranks of a group.

    Every rank enters the same `with` block. The ranks that share a folder (`build_ranks.py`
    finds out which) write into one temp folder next to `target`, made by their leader (after
    sweeping dead builders' temps); every rank writes its part files into `path`.
    `concat(name)` (or `collect`, for a join of your own) first brings every rank's part into
    each folder, then `publish(header)` waits for all ranks and each leader writes
    `header.json` and renames its folder into place. An exception, or a rank that dies (the
    collectives fail), leaves nothing published; the leader removes its temp folder, or a
    later build sweeps it.

    Args:
        target: the cache folder.
        distributed: split over the initialised `torch.distributed` group (every rank calls);
            None (the default): when one of more than one rank is initialised.
        inputs: what identifies the inputs (the cache's fingerprint), which every rank must
            give alike: ranks whose data differ raise `BuildInputsError`, naming them.
        local: header fields that are each folder's own (the image cache's `root`): rewritten,
            and the header sealed again, in a copy received from another folder.

    Example:
        >>> build = FolderBuild(cache_dir)
        >>> if build.needed(lambda: MyCache.open(cache_dir, fingerprint=fp), MyCacheError):
        ...     with build:
        ...         for i in build.block(n):
        ...             write_item(i, build.part("data.bin"))  # yours: append item i's bytes
        ...         build.concat("data.bin")
        ...         build.publish({"format": "my-cache", "version": 1, "fingerprint": fp})
    """

    def __init__(
        self,
        target: str | os.PathLike,
        *,
        distributed: bool | None = None,
        inputs: str | None = None,
        local: dict | None = None,
    ):
        self.target = Path(target)
        self.inputs = inputs
        self.local = dict(local or {})
        self.distributed = distributed_build(distributed)
        self.ranks = BuildRanks.alone()
        self.path: Path | None = None
        self._joined = not self.distributed
        self._published = False
        self._open_cache: Callable[[], object] | None = None
        self._error: type[Exception] = Exception

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world(self) -> int:
        return self.ranks.world

    @property
    def leader(self) -> bool:
        """Whether this rank joins the parts and publishes in its folder (the first rank of the
        ranks that share it; rank 0 of a build on one folder)."""
        return self.ranks.leader

    def _join(self) -> None:
        if not self._joined:
            self.ranks = BuildRanks.join(self.target.parent, self.target.name)
            self._joined = True
            if self.inputs is not None:
                check_inputs(self.ranks.gather(self.inputs), self.target.name)

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
        """Whether to build: each folder's leader tries `open_cache()`, which raises `error` for
        a missing, stale or damaged cache, and every rank gets the answer. A folder without a
        valid cache while another folder holds one receives a copy of it (no build). Leaders
        first remove the temp folders of this cache's dead builders (a build killed midway)."""
        self._join()
        self._open_cache = open_cache
        self._error = error
        valid = None
        if self.leader:
            if self.target.parent.is_dir():  # a build killed midway, even when no build follows
                sweep_dead_temps(self.target.parent, self.target.name)
            valid = self._valid()
        answers = self.ranks.gather(valid)
        holders = [r for r in self.ranks.leaders if answers[r]]
        if not holders:
            return True
        if len(holders) < len(self.ranks.leaders):
            self._copy_from(holders[0], needs=self.leader and not answers[self.rank])
        return False

    def _copy_from(self, source: int, *, needs: bool) -> None:
        """Each leader whose folder lacks the cache receives `source`'s copy into a temp folder,
        published as a build's is (kept when a valid one appeared meanwhile)."""
        if self.leader:
            temp = None
            if needs:
                self.target.parent.mkdir(parents=True, exist_ok=True)
                temp = Path(
                    tempfile.mkdtemp(
                        prefix=f".{self.target.name}.{_host()}.{os.getpid()}.",
                        suffix=".tmp",
                        dir=self.target.parent,
                    )
                )
            try:
                folder = None  # the source's own copy; None on the receiving leaders
                if self.rank == source:
                    folder = self.target
                self.ranks.send_tree(source, folder, temp)
                if temp is not None:
                    self._localise(temp)
                    replace_dir(temp, self.target, keep=self._valid)
            finally:
                if temp is not None and temp.exists():
                    shutil.rmtree(temp, ignore_errors=True)
        self.ranks.barrier()  # no rank reads its folder's cache before it is in place

    def _localise(self, folder: Path) -> None:
        """A received copy's header with this folder's own `local` fields, sealed again."""
        path = folder / "header.json"
        if not self.local or not path.exists():
            return
        header = json.loads(path.read_text())
        header.pop("header_sha256", None)
        header.update(self.local)
        write_synced(
            path, json.dumps({**header, "header_sha256": _seal(header)}, indent=1).encode("utf-8")
        )

    def __enter__(self) -> FolderBuild:
        self._join()
        where = None
        if self.leader:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            sweep_dead_temps(self.target.parent, self.target.name)
            where = tempfile.mkdtemp(
                prefix=f".{self.target.name}.{_host()}.{os.getpid()}.",
                suffix=".tmp",
                dir=self.target.parent,
            )
        self.path = Path(self.ranks.from_leader(where))
        return self

    def __exit__(self, *exc) -> None:
        if self.leader and not self._published and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def block(self, n: int) -> range:
        """This rank's contiguous share of `range(n)` (rank order is index order)."""
        return range(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def part(self, name: str, rank: int | None = None) -> Path:
        if rank is None:
            rank = self.rank
        return self.path / f"{name}.part{rank}"

    def barrier(self) -> None:
        self.ranks.barrier()

    def gather(self, value) -> list:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        return self.ranks.gather(value)

    def collect(self, *names: str) -> None:
        """Every rank's `part(name)` of each name, complete, in each leader's folder (moved
        over the process group from the folders that have them). Collective."""
        self.ranks.exchange(lambda rank: [self.part(name, rank) for name in names])

    def concat(self, name: str) -> None:
        """Each leader joins every rank's `part(name)` into `name`, in rank order (collective)."""
        self.collect(name)
        if not self.leader:
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
        """After every rank is done: each leader writes its `header` to `header.json` and renames
        its folder into place (the other ranks' `header` is ignored). When another process has
        published a valid copy meanwhile (the `open_cache` of `needed` opens it), that copy
        stays and this build is deleted: the first to publish wins."""
        self.barrier()
        if self.leader:
            header = {**header, "header_sha256": _seal(header)}
            write_synced(self.path / "header.json", json.dumps(header, indent=1).encode("utf-8"))
            replace_dir(self.path, self.target, keep=self._valid)
        self._published = True
        self.barrier()  # no rank reads the cache before it is in place


class BuildInputsError(ValueError):
    """The ranks of a distributed build were given other inputs (their data differ)."""


def check_inputs(keys: list, name: str) -> None:
    """Raises `BuildInputsError` naming the ranks of each differing input key (every rank gets
    the same list, so every rank raises)."""
    if len(set(keys)) <= 1:
        return
    ranks: dict = {}
    for rank, key in enumerate(keys):
        ranks.setdefault(key, []).append(rank)
    seen = "; ".join(f"ranks {r} have {str(k)[:12]}..." for k, r in ranks.items())
    raise BuildInputsError(
        f"Building {name}: the ranks' inputs differ ({seen}), so no one cache serves them all. "
        "Give every node the same data: the same files under the same relative paths, with their "
        "sizes and modification times (an image cache's fingerprint covers them: copy with cp -p "
        "or rsync -a, which keep the times), the same texts and tokenizer; or build on each node "
        "with distributed=False."
    )
