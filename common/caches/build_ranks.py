"""The ranks of a cache build split over a process group: which of them share a folder, and how
every folder gets every rank's part, so that a build needs no shared file system.

Use when: a `build_*` step runs on every rank of an initialised `torch.distributed` group
(`FolderBuild`, an eval view) and each node must end with the whole cache on its own disk (a
relative `cache_dir` on each node's NVMe), or once on a disk the nodes share.
Cost: at the start, a rendezvous in the group's store (a key per rank) and one marker file per
rank, listed by every rank, then an all-gather; per part file a folder lacks, one broadcast of
its bytes (`CHUNK_BYTES` at a time) over a gloo group of one rank per folder (its leader): each
of F folders receives the (F - 1) / F of the parts written elsewhere. With one folder (one
node, or a shared file system) nothing moves.
Adapt here: `RENDEZVOUS_S` (how long a build waits for every rank to call it; rank 0 warns after
`NOTICE_S`), `CHUNK_BYTES`.
Trade-off: every folder ends with the whole cache, so any rank reads any sample (an elastic
resume on any shape, no node-affine sampler): the price is the whole cache's disk on every
node and the transfer of the parts written on other nodes. Which ranks share a folder is seen,
not guessed from hostnames (a shared file system spans nodes; two containers on one host may
not share a disk): each rank writes a marker into the folder and lists the others'.
Copy with: common/caches/cache_files.py, common/workers/held_descriptors.py.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from recipes.common.caches.cache_files import _host

RENDEZVOUS_S = 300.0  # every rank calls a distributed build within this long of the first one
NOTICE_S = 30.0  # after this long, rank 0 warns that it waits for the others
CHUNK_BYTES = 16 * 2**20
_SEQUENCE = itertools.count()  # this process's distributed builds: the n-th meets the others' n-th


class _Gloo(NamedTuple):
    """A gloo group over every rank, made for the default group `world`."""

    world: object
    group: object


_GLOO: list[_Gloo] = []  # the gloo group made, when the default backend is not gloo


class BuildRendezvousError(RuntimeError):
    """Not every rank of the process group called the distributed build in time."""


@dataclass(frozen=True)
class BuildRanks:
    """One distributed build as this rank sees it: the ranks, and which share a folder.

    `groups` holds the ranks of each folder (sorted, in order of their first rank); a folder's
    first rank is its leader: it makes the temp folder, joins the parts and publishes there.
    """

    rank: int
    world: int
    groups: tuple[tuple[int, ...], ...]
    gloo: object = None  # the gloo group collectives run in (None: the default group)
    leaders_group: object = None  # a gloo group of the leaders, when there are several folders

    @classmethod
    def alone(cls) -> BuildRanks:
        return cls(0, 1, ((0,),))

    @classmethod
    def join(cls, folder: Path, what: str) -> BuildRanks:
        """Every rank of the initialised group calls this at the same point of the same build:
        it meets the others (`BuildRendezvousError` naming how many came, after `RENDEZVOUS_S`)
        and finds out which ranks share `folder` (created). Collective."""
        import torch.distributed as dist

        rank = dist.get_rank()
        world = dist.get_world_size()
        _rendezvous(rank, world, what)
        gloo = _gloo_group()
        token = None
        if rank == 0:
            token = uuid.uuid4().hex
        token = _broadcast(token, 0, gloo)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".{what}.{_host()}.{os.getpid()}.share-{token}-{rank}.tmp"
        marker.touch()
        try:
            tag = f".share-{token}-"
            seen = sorted(
                int(name.rsplit(tag, 1)[1][:-4])
                for name in os.listdir(folder)
                if tag in name and name.endswith(".tmp")
            )
            sightings = _gather(seen, world, gloo)  # every rank has listed before any marker goes
        finally:
            marker.unlink(missing_ok=True)
        groups = _components(sightings)
        leaders = [g[0] for g in groups]
        leaders_group = None
        if len(groups) > 1:
            leaders_group = dist.new_group(ranks=leaders, backend="gloo")
        return cls(rank, world, groups, gloo, leaders_group)

    # ---- who is who ------------------------------------------------------------------------
    @property
    def group(self) -> tuple[int, ...]:
        """The ranks that share this rank's folder, its leader first."""
        return next(g for g in self.groups if self.rank in g)

    @property
    def leader(self) -> bool:
        return self.rank == self.group[0]

    @property
    def leaders(self) -> list[int]:
        return [g[0] for g in self.groups]

    # ---- collectives -----------------------------------------------------------------------
    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.gloo)

    def gather(self, value) -> list:
        """Every rank's `value` (small, picklable), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        return _gather(value, self.world, self.gloo)

    def from_leader(self, value):
        """This rank's folder leader's `value`, on every rank of the folder."""
        return self.gather(value)[self.group[0]]

    def exchange(self, paths: Callable[[int], Sequence[Path]]) -> None:
        """Every leader ends with `paths(r)` for every rank `r`: each path names a file in this
        rank's folder (the same names in every folder), written there by `r` or by a rank sharing
        it; a folder that lacks `r`'s files receives them from the leader of `r`'s folder.
        Collective; only leaders move bytes (after a barrier: every part complete)."""
        self.barrier()
        if len(self.groups) == 1 or not self.leader:
            return
        for source in self.groups:
            for rank in source:
                self.send(source[0], list(paths(rank)))

    def send(self, source: int, files: Sequence[Path | None]) -> None:
        """Leaders only: `source`'s `files` (paths in each leader's folder, the same names) into
        every other leader's folder, byte for byte, fsynced; a receiver's None takes part in the
        broadcast and keeps nothing."""
        import torch
        import torch.distributed as dist

        mine = self.rank == source
        sizes = None
        mode = "wb"
        if mine:
            sizes = [os.path.getsize(p) for p in files]
            mode = "rb"
        sizes = _broadcast(sizes, source, self.leaders_group)
        for path, size in zip(files, sizes, strict=True):
            with contextlib.ExitStack() as stack:
                f = None
                if path is not None:
                    f = stack.enter_context(open(path, mode))
                left = size
                while left:
                    n = min(CHUNK_BYTES, left)
                    if mine:
                        chunk = torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8)
                    else:
                        chunk = torch.empty(n, dtype=torch.uint8)
                    dist.broadcast(chunk, src=source, group=self.leaders_group)
                    if f is not None and not mine:
                        f.write(chunk.numpy().tobytes())
                    left -= n
                if f is not None and not mine:
                    f.flush()
                    os.fsync(f.fileno())

    def send_tree(self, source: int, folder: Path | None, into: Path | None) -> None:
        """Leaders only: every file under `source`'s `folder` (names starting with a dot, such
        as temps, left out) into each receiving leader's `into` (None: a leader that needs
        nothing, which still takes part)."""
        mine = self.rank == source
        names = None
        if mine:
            names = _files_under(folder)
        names = _broadcast(names, source, self.leaders_group)
        if mine:
            self.send(source, [folder / name for name in names])
            return
        if into is not None:
            for name in names:
                (into / name).parent.mkdir(parents=True, exist_ok=True)
        targets = [None] * len(names)
        if into is not None:
            targets = [into / name for name in names]
        self.send(source, targets)


def _files_under(folder: Path) -> list[str]:
    """The files under `folder`, relative to it, sorted; names starting with a dot (temps, at
    any depth) left out."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def distributed_build(distributed: bool | None) -> bool:
    """Whether a build splits over the ranks: `distributed`, or by default (None) whether a
    process group of more than one rank is initialised.

    Raises:
        ValueError: `distributed=True` without an initialised process group."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if distributed and not initialised:
        raise ValueError(
            "distributed=True needs an initialised torch.distributed process group "
            "(dist.init_process_group); without one, leave `distributed` at None."
        )
    if distributed is None:
        return bool(initialised and dist.get_world_size() > 1)
    return bool(distributed) and dist.get_world_size() > 1


def _components(sightings: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """The folders: ranks joined when either saw the other's marker (a listing may lag behind
    a shared file system's writes on one side only)."""
    parent = list(range(len(sightings)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for rank, seen in enumerate(sightings):
        for other in seen:
            parent[root(other)] = root(rank)
    groups: dict[int, list[int]] = {}
    for rank in range(len(sightings)):
        groups.setdefault(root(rank), []).append(rank)
    return tuple(sorted(tuple(g) for g in groups.values()))


def _rendezvous(rank: int, world: int, what: str) -> None:
    """Waits until every rank has entered this process's next distributed build, through the
    group's store (no collective, so a call on some ranks only fails clearly instead of
    pairing with another collective of the others)."""
    import torch.distributed as dist

    store_of = getattr(dist.distributed_c10d, "_get_default_store", None)
    if store_of is None:  # no store to meet in (a future torch): the first collective meets
        return
    store = store_of()
    key = f"recipes/build/{next(_SEQUENCE)}"
    if store.add(key, 1) >= world:
        store.set(f"{key}/all", "1")
    first = min(NOTICE_S, RENDEZVOUS_S)
    try:
        try:
            store.wait([f"{key}/all"], datetime.timedelta(seconds=first))
        except (
            RuntimeError
        ):  # torch's DistStoreError (a RuntimeError) on the timeout: say so, wait on
            if rank == 0:
                warnings.warn(
                    f"Building {what}: {store.add(key, 0)} of the {world} ranks have called the "
                    f"build after {first:.0f} s; waiting up to {RENDEZVOUS_S:.0f} s for the others "
                    "(every rank makes this call; distributed=False builds on one rank).",
                    stacklevel=4,
                )
            store.wait([f"{key}/all"], datetime.timedelta(seconds=max(0.1, RENDEZVOUS_S - first)))
    except RuntimeError:
        came = store.add(key, 0)
        raise BuildRendezvousError(
            f"Building {what}: only {came} of the {world} ranks called the build within "
            f"{RENDEZVOUS_S:.0f} s. Under an initialised process group a build_* call splits its "
            "work over every rank, so every rank makes the same call; to build on one rank only "
            "(then a barrier), pass distributed=False."
        ) from None


def _gloo_group():
    """A gloo group over every rank (the default group when its backend is gloo), made once per
    default group: part files move as CPU tensors whatever the training backend (NCCL)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if not _GLOO or _GLOO[0].world is not world:
        _GLOO[:] = [_Gloo(world, dist.new_group(backend="gloo"))]
    return _GLOO[0].group


def _gather(value, world: int, group) -> list:
    import torch.distributed as dist

    values = [None] * world
    dist.all_gather_object(values, value, group=group)
    return values


def _broadcast(value, source: int, group):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]
