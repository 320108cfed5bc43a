"""Hugging Face Accelerate glue: `prepare_loader` keeps a recipes loader as it is under an
`Accelerator`.

Use when: you train with `accelerate` (an `Accelerator`, launched by `torchrun` or `accelerate
launch`) from a `make_loader` loader (`StatefulLoader`, `ThreadLoader`, `RobustLoader`, or a
`LoaderMonitor` around one) and want `accelerator.save_state()` / `load_state()` to resume it
mid-epoch exactly, at once: the loader's state is saved with the checkpoint, one JSON file per
rank, and a resumed loader starts at the first batch the loop had not received, without
reading the ones before it.
Cost: per batch, two `state_dict()` calls (2-4 us each: the loop's state behind the one batch
read ahead, as accelerate's own loaders read ahead to announce an epoch's end) and, with
device placement, accelerate's `send_to_device`; per `save_state`, a ~7 KB JSON file per rank.
Adapt here: `device_placement=` (off when your step moves batches itself), `name=` (one per
loader prepared on the same `Accelerator`).
Trade-off: `accelerator.prepare(loader)` rebuilds a plain DataLoader from the loader's
attributes (our sampler wrapped in a `BatchSamplerShard`; the threads, the state and the
resume are lost, and `save_state` then fails with "'DataLoader' object has no attribute
'dl_state_dict'" for a loader registered for checkpointing). Here the loader is kept, so it
must already be split over the ranks: a `DistributedSampler`, or a sampler of ours that reads
the `torch.distributed` world (`LengthBucketSampler`, `PackedBatchSampler`, `MixtureSampler`,
`ShardedIterableDataset`), which `prepare_loader` checks. Accelerate's per-epoch generator
synchronisation is not needed: those draw their order from `(seed, epoch)` on every rank.
Never pass the result to `accelerator.skip_first_batches`: the loader resumes itself.

The wrapper does for accelerate what `DataLoaderShard` does (accelerate's `DataLoaderStateMixin`
protocol): it registers with the `GradientState` while an epoch runs and sets
`end_of_dataloader` on the last batch, so `accelerator.accumulate()` steps at an epoch's end.
Needs accelerate (`pip install "loader-recipes[accelerate]"`), imported only by the functions that
use it.
Copy with: nothing."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "AcceleratedLoader",
    "check_split",
    "innermost",
    "loader_state_path",
    "prepare_loader",
    "read_loader_state",
    "write_loader_state",
]

_END = object()
_FORMAT = "recipes-loader-state"
# names already prepared on each Accelerator (two loaders under one name would share a file)
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _ReadAhead(NamedTuple):
    """The states around a batch read ahead of the loop."""

    at_loop: dict  # the loader's state when the loop received its latest batch
    at_loader: dict  # the loader's state after the batch read ahead


class AcceleratedLoader:
    """A recipes loader as accelerate's prepared loaders behave: batches on the accelerator's
    device, the epoch's end announced to gradient accumulation, and `state_dict()` giving the
    loop's place (the batches it received), though one batch is read ahead.

    Args:
        loader: a recipes loader (anything with `state_dict()` / `load_state_dict()`).
        accelerator: the `accelerate.Accelerator` training with it.
        device_placement: move each batch to `accelerator.device` (accelerate's default).

    Other attributes (`dataset`, `batch_sampler`, `recipe`, `summary()`...) are the loader's.
    """

    def __init__(self, loader, *, accelerator, device_placement: bool = True):
        if not (
            callable(getattr(loader, "state_dict", None))
            and callable(getattr(loader, "load_state_dict", None))
        ):
            raise TypeError(
                "AcceleratedLoader wraps a loader with state_dict() and load_state_dict() "
                f"(make_loader's); {type(loader).__name__} has not both. Build it with "
                "recipes.common.make_loader."
            )
        self.loader = loader
        self.device = None
        if device_placement:
            self.device = accelerator.device
        self.non_blocking = bool(getattr(accelerator, "non_blocking", False))
        self.gradient_state = accelerator.gradient_state
        self.end_of_dataloader = False  # accelerate's DataLoaderStateMixin attributes
        self.remainder = -1
        self._held: _ReadAhead | None = None  # while a batch is read ahead

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        self._held = None
        return self._batches(
            iter(self.loader)
        )  # the loader's pass starts now, as a DataLoader's would

    def _batches(self, iterator):
        self.end_of_dataloader = False
        self.remainder = -1
        self.gradient_state._add_dataloader(self)  # what DataLoaderStateMixin.begin() does
        try:
            batch = next(iterator, _END)
            while batch is not _END:
                # the loop's place: this batch received, the next not
                received = self.loader.state_dict()
                following = next(iterator, _END)
                self.end_of_dataloader = following is _END
                self._held = None
                if following is not _END:
                    self._held = _ReadAhead(received, self.loader.state_dict())
                yield self._placed(batch)
                batch = following
        finally:
            self.gradient_state._remove_dataloader(self)

    def _placed(self, batch):
        if self.device is None:
            return batch
        from accelerate.utils import send_to_device

        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state at the loop's place: while a batch is read ahead, the state before
        it was read (unless the loader moved since: `set_epoch`, `load_state_dict`)."""
        live = self.loader.state_dict()
        if self._held is not None and live == self._held.at_loader:
            return self._held.at_loop
        return live

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The loader resumes from `state` at its next `iter` (`StatefulLoader.load_state_dict`)."""
        self._held = None
        self.loader.load_state_dict(state)

    @property
    def epoch(self) -> int:
        """The epoch the next `iter` continues (a loaded mid-epoch state) or starts: where a
        resumed loop begins, `for epoch in range(loader.epoch, epochs)`."""
        state = self.state_dict()
        if state.get("finished_epoch") is not None:
            return int(state["finished_epoch"]) + 1
        return int(state.get("epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """`set_epoch(epoch)` on the loader's sampler, batch sampler and dataset that have one
        (the same epoch as a loaded state keeps its place; another starts that epoch afresh)."""
        inner = innermost(self.loader)
        done = set()
        for holder in (
            getattr(inner, "batch_sampler", None),
            getattr(inner, "sampler", None),
            getattr(inner, "dataset", None),
        ):
            if (
                holder is not None
                and id(holder) not in done
                and callable(getattr(holder, "set_epoch", None))
            ):
                holder.set_epoch(epoch)
                done.add(id(holder))


def prepare_loader(
    accelerator, loader, *, device_placement: bool | None = None, name: str = "train"
) -> AcceleratedLoader:
    """`loader`, kept as it is under `accelerator`, and saved and loaded by its `save_state` /
    `load_state` (a `recipes_loader-<name>.rank<r>.json` per rank in the checkpoint folder).

    Args:
        accelerator: the `accelerate.Accelerator`.
        loader: a recipes loader, already split over the ranks (see the module doc).
        device_placement: move batches to `accelerator.device`; the accelerator's setting when None.
        name: the loader's name in checkpoints, one per loader prepared on this accelerator.

    Raises:
        ValueError: the loader is not split over `accelerator.num_processes` ranks the way this
            process's rank expects, or `name` is taken on this accelerator.

    Example:
        >>> loader = make_loader(dataset, batch_size=32, sampler=sampler)
        >>> loader = prepare_loader(accelerator, loader)
        >>> model, optimizer = accelerator.prepare(model, optimizer)
        >>> accelerator.load_state("ckpt")            # when resuming: the loader's place too
        >>> for epoch in range(loader.epoch, epochs):
        ...     loader.set_epoch(epoch)
        ...     for batch in loader: ...               # accelerator.save_state("ckpt") any time
    """
    check_split(loader, accelerator.num_processes, accelerator.process_index)
    names = _PREPARED.setdefault(accelerator, set())
    if name in names:
        raise ValueError(
            f"A loader named {name!r} is already prepared on this Accelerator; pass another "
            "`name=` for each loader (it names the loader's file in a checkpoint)."
        )
    names.add(name)
    placement = device_placement
    if placement is None:
        placement = accelerator.device_placement
    wrapped = AcceleratedLoader(loader, accelerator=accelerator, device_placement=placement)
    rank = accelerator.process_index
    world = accelerator.num_processes

    def save(models, weights, output_dir) -> None:  # accelerate calls it on every rank
        write_loader_state(output_dir, name, wrapped.state_dict(), rank=rank, world_size=world)

    def load(models, input_dir) -> None:
        wrapped.load_state_dict(read_loader_state(input_dir, name, rank=rank, world_size=world))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return wrapped


def innermost(loader):
    """The DataLoader inside `LoaderMonitor` / `RobustLoader` wrappers (each holds `.loader`)."""
    seen = 0
    while hasattr(loader, "loader") and seen < 8:
        loader = loader.loader
        seen = seen + 1
    return loader


def check_split(loader, num_processes: int, process_index: int) -> None:
    """Raises a `ValueError` unless `loader` gives this rank its own share of `num_processes`:
    its batch sampler, sampler or dataset says `num_replicas`/`world_size` and `rank` (a single
    process may read everything, unless the launcher started several: `WORLD_SIZE`)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if num_processes == 1 and launched > 1:
        raise ValueError(
            f"This process is one of WORLD_SIZE={launched} launched, but runs alone (1 process): "
            "every process would train on all the data and write the same checkpoint files. On "
            "CPUs, accelerate joins the processes only with Accelerator(cpu=True) "
            "(TrainingArguments(use_cpu=True) for the Trainer)."
        )
    inner = innermost(loader)
    batch_sampler = getattr(inner, "batch_sampler", None)
    holders = (
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(inner, "sampler", None),
        getattr(inner, "dataset", None),
    )
    holder = next((h for h in holders if h is not None and _world_of(h) is not None), None)
    if holder is None:
        if num_processes > 1:
            raise ValueError(
                f"This loader reads the whole dataset on every rank ({num_processes} processes): "
                "nothing in it says num_replicas/world_size and rank. Split it over the ranks: "
                "make_loader(dataset, batch_size=..., sampler=DistributedSampler(dataset, "
                "shuffle=True, seed=0)), or a LengthBucketSampler / ShardedIterableDataset built "
                "after the Accelerator (they read the torch.distributed world)."
            )
        return
    world, rank = _world_of(holder)
    if (world, rank) != (num_processes, process_index):
        raise ValueError(
            f"{type(holder).__name__} is split for rank {rank} of {world}, but this process is "
            f"rank {process_index} of {num_processes}. Build it after the Accelerator, or pass "
            f"num_replicas={num_processes}, rank={process_index}."
        )


def _world_of(holder) -> tuple[int, int] | None:
    for world_name in ("num_replicas", "world_size"):
        world = getattr(holder, world_name, None)
        if isinstance(world, int) and isinstance(getattr(holder, "rank", None), int):
            return world, holder.rank
    return None


def loader_state_path(folder, name: str, rank: int) -> Path:
    """Where a rank's loader state lives in a checkpoint folder."""
    return Path(folder) / f"recipes_loader-{name}.rank{rank}.json"


def write_loader_state(
    folder, name: str, state: dict[str, Any], *, rank: int, world_size: int
) -> Path:
    """Writes `state` (plain JSON) for `rank` into `folder`, atomically (a crash mid-write
    leaves the previous file whole)."""
    path = loader_state_path(folder, name, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "format": _FORMAT,
        "version": 1,
        "name": name,
        "rank": rank,
        "world_size": world_size,
        "state": state,
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def read_loader_state(folder, name: str, *, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's loader state from a checkpoint folder; on another number of ranks, rank 0's
    (the loader then resumes elastically, or refuses naming why: `StatefulLoader.load_state_dict`).

    Raises:
        FileNotFoundError: no state of this loader in `folder` (saved without `prepare_loader`?).
        ValueError: the file is not a loader state.
    """
    path = loader_state_path(folder, name, rank)
    first = loader_state_path(folder, name, 0)
    if path.is_file():
        record = _record(path)
        if record.get("world_size") == world_size:
            return record["state"]
    if not first.is_file():
        found = []
        if Path(folder).is_dir():
            found = sorted(p.name for p in Path(folder).glob("recipes_loader-*.json"))
        raise FileNotFoundError(
            f"No state of the loader {name!r} in {folder} (expected {path.name}; found "
            f"{found or 'no loader state'}). Resume from a checkpoint saved while the loader was "
            f"prepared with prepare_loader(..., name={name!r}), or start the epoch afresh."
        )
    record = _record(first)
    if (
        record.get("world_size") == world_size
    ):  # saved on as many ranks, yet this rank's file is not there
        raise FileNotFoundError(
            f"{path.name} is missing from {folder}, which was saved on {world_size} ranks: the "
            "checkpoint is incomplete; resume from an earlier one."
        )
    return record["state"]


def _record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{path} is not a readable loader state ({error}); the checkpoint is damaged: resume "
            "from an earlier one."
        ) from error
    if (
        not isinstance(record, dict)
        or record.get("format") != _FORMAT
        or not isinstance(record.get("state"), dict)
    ):
        raise ValueError(
            f"{path} is not a recipes loader state (no {_FORMAT!r} record); resume from a "
            "checkpoint written by prepare_loader."
        )
    return record
