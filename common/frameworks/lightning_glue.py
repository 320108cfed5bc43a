"""Lightning glue: `LoaderDataModule`, a DataModule whose checkpoints resume a `make_loader` loader
exactly.

Use when: you train with Lightning (2.2+; read in 2.6's source) from a `make_loader` loader
(`StatefulLoader`, `ThreadLoader`, `RobustLoader`), resume with `Trainer.fit(..., ckpt_path=)`,
and want the resumed run to train on the batches the interrupted one had not, in its order, on
every rank, also when `configure_optimizers` reads `trainer.estimated_stepping_batches`.
Cost: the loader's state (~7 KB of JSON) saved twice per checkpoint (Lightning's copy and this
module's); a `set_epoch` call per epoch; nothing per batch.
Adapt here: `train_loader()`, the hook that builds the loader (a sampler of ours,
`path="threads"`, a `RobustLoader`); `seed`, the order of a shuffled loader on several ranks.
Trade-off: the checkpoint holds rank 0's loader state (Lightning's rule): right for loaders
whose ranks step together (`ElasticDistributedSampler`, `LengthBucketSampler`,
`PackedBatchSampler`), which also resume it on another number of ranks (the loader's length then
covers both the resumed epoch and a whole one: Lightning reads it once); a loader without a
length is read one batch ahead by Lightning, so its mid-epoch resume skips a batch:
`train_dataloader()` warns (`LoaderWarning`).

What Lightning does, and what this module adds:
- Lightning saves each training loader's `state_dict()` and, on resume, calls its
  `load_state_dict()` in `FitLoop.setup_data()`, just before `iter()`: exact by itself.
- A `configure_optimizers` that reads `trainer.estimated_stepping_batches` (OneCycleLR) runs
  `setup_data()` inside `strategy.setup()`, before the checkpoint's loop states are restored;
  the later `setup_data()` returns early and the loader's state is never loaded
  (Lightning-AI/pytorch-lightning#20550; measured: 13 of 64 samples repeated, 13 lost, later
  epochs in another order). A DataModule's own state is restored before `strategy.setup()`:
  this one saves the loader's state there too and loads it into the loader it builds.
- `use_distributed_sampler=True` (the default) re-creates a map-style loader whose sampler is
  not a `DistributedSampler`: a state loaded into the old loader is lost, and a batch sampler
  of ours cannot be re-created (`LengthBucketSampler` fails inside Lightning). On several ranks
  the default `train_loader()` gives the loader an `ElasticDistributedSampler` (a
  `DistributedSampler`), which Lightning keeps; a
  loader with a sampler or batch sampler of its own needs `use_distributed_sampler=False`, and
  `train_dataloader()` raises, naming it.
- Lightning calls `set_epoch` on `loader.sampler` and `loader.batch_sampler.sampler` only; a
  callback this module adds to the trainer calls that of a batch sampler (`LengthBucketSampler`)
  or an iterable dataset, at each epoch's start.
- Lightning calls `iter()` before it sets the epoch; resumed from a checkpoint taken at an
  epoch's last step, it starts the next epoch on the loader's empty rest of the old one (a
  loader that counts its own epochs, `make_loader(shuffle=True)` without a sampler, then loses
  that epoch: measured, plain Lightning trains 64 of 192 samples fewer). This module's loader
  draws its order from an `ElasticDistributedSampler` (one rank or more), whose `set_epoch` begins
  the right epoch (an iterator that handed no batch over follows a later `set_epoch`).
Importing this module does not import Lightning: `LoaderDataModule` is built on first use, as
`LoaderDataModuleMixin` on `lightning.pytorch.LightningDataModule`.
Copy with: common/caches/cache_files.py, common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated/child.py,
  common/loading/isolated/protocol.py, common/loading/isolated_loader.py, common/loading/loader.py,
  common/loading/loader_path.py, common/loading/loader_rules.py, common/loading/loop_probe.py,
  common/loading/stateful_loader.py, common/loading/thread_loader.py,
  common/loading/worker_rules.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sampling/elastic_sampler.py, common/sampling/sharding.py,
  common/sizing/profiles.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/sizing/tune_store.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from recipes.common.loader_warning import LoaderWarning
from recipes.common.loading.loader import make_loader
from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler

__all__ = ["LoaderDataModule", "LoaderDataModuleMixin", "check_sampler_kept", "epoch_holders"]  # noqa: F822 (lazy)


class LoaderDataModuleMixin:
    """`LoaderDataModule`'s methods without Lightning's base class: put it first on a
    DataModule class of your own (`class Data(LoaderDataModuleMixin, LightningDataModule)`).

    Args:
        dataset: the training dataset (the default `train_loader()` reads it).
        seed: the order's seed (the default `train_loader()`'s `ElasticDistributedSampler`, the same
            on every rank).
        **loader_kwargs: `make_loader`'s arguments (`batch_size`, `shuffle`, `num_workers`, ...).

    Example:
        >>> data = LoaderDataModule(dataset, batch_size=32, shuffle=True, num_workers=4)
        >>> trainer.fit(model, datamodule=data, ckpt_path="last.ckpt")   # resumes mid-epoch
    """

    def __init__(self, dataset=None, *, seed: int = 0, **loader_kwargs: Any):
        super().__init__()
        self.dataset = dataset
        self.seed = seed
        self.loader_kwargs = loader_kwargs
        self.loader = None  # the training loader built last: the one Lightning iterates
        self._state_to_load: dict[str, Any] | None = None

    def train_loader(self):
        """The training loader; override to build your own. By default `make_loader(dataset,
        **loader_kwargs)`, given an `ElasticDistributedSampler` (`shuffle`, `seed`, this trainer's
        ranks, one or more) when it has no sampler: its order follows the epoch Lightning sets."""
        kwargs = dict(self.loader_kwargs)
        world, rank = _ranks(self.trainer)
        if (
            not isinstance(self.dataset, IterableDataset)
            and kwargs.get("sampler") is None
            and kwargs.get("batch_sampler") is None
        ):
            kwargs["sampler"] = ElasticDistributedSampler(
                self.dataset,
                num_replicas=world,
                rank=rank,
                seed=self.seed,
                shuffle=bool(kwargs.pop("shuffle", False)),
                drop_last=bool(kwargs.get("drop_last", False)),
            )
        return make_loader(self.dataset, **kwargs)

    @property
    def start_epoch(self) -> int:
        """The epoch the next training loader starts in: the checkpoint's, while its state waits
        to be loaded (`train_dataloader()` may run before Lightning restores `current_epoch`:
        #20550), else the trainer's current epoch (0 outside a trainer). For per-epoch settings
        of the dataset that `train_loader()` applies (a resolution schedule)."""
        if self._state_to_load is not None:
            return int(self._state_to_load["epoch"])
        if self.trainer is None:
            return 0
        return int(self.trainer.current_epoch)

    def train_dataloader(self):
        loader = self.train_loader()
        check_sampler_kept(self.trainer, loader)
        _warn_without_length(loader)
        if self._state_to_load is not None:  # restored before Lightning's own copy (#20550)
            loader.load_state_dict(self._state_to_load)
            self._state_to_load = None
        self.loader = loader
        return loader

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.trainer is not None and not any(
            getattr(c, "sets_loader_epochs", False) for c in self.trainer.callbacks
        ):
            self.trainer.callbacks.append(_epoch_callback())

    def state_dict(self) -> dict[str, Any]:
        if self.loader is None or not callable(getattr(self.loader, "state_dict", None)):
            return {}
        return {"train_loader": self.loader.state_dict(), "world_size": _ranks(self.trainer)[0]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state_to_load = state_dict.get("train_loader")


def check_sampler_kept(trainer, loader) -> None:
    """Raises when Lightning would replace `loader`'s sampler (and so re-create the loader).

    Raises:
        ValueError: several ranks, `use_distributed_sampler=True`, and a map-style DataLoader
            whose sampler is not a `DistributedSampler`.
    """
    if (
        trainer is None
        or _ranks(trainer)[0] < 2
        or not isinstance(loader, DataLoader)
        or isinstance(loader.dataset, IterableDataset)
        or isinstance(loader.sampler, DistributedSampler)
    ):
        return
    # Lightning 2.6 keeps the flag here, with no public accessor; missing, assume its default
    if not getattr(
        getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", True
    ):
        return
    if loader.batch_size is None:
        own = f"batch sampler {type(loader.batch_sampler).__name__}"
    else:
        own = f"sampler {type(loader.sampler).__name__}"
    raise ValueError(
        f"Trainer(use_distributed_sampler=True) would replace this {type(loader).__name__}'s {own} "
        "with a DistributedSampler, re-creating the loader (its loaded state lost; a batch "
        "sampler of recipes cannot be re-created). Pass Trainer(use_distributed_sampler=False) "
        "when the sampler splits the data over the ranks itself (LengthBucketSampler, "
        "PackedBatchSampler, MixtureSampler and DistributedSampler do), or build the loader with "
        "a DistributedSampler."
    )


def epoch_holders(loader) -> list:
    """What carries `loader`'s epoch beyond the two places Lightning sets it (`loader.sampler`,
    `loader.batch_sampler.sampler`): a batch sampler with `set_epoch` (`LengthBucketSampler`,
    not torch's `BatchSampler`) and an iterable dataset with one (`ShardedIterableDataset`)."""
    found = [getattr(loader, "batch_sampler", None)]
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        found.append(loader.dataset)
    return [obj for obj in found if callable(getattr(obj, "set_epoch", None))]


def _warn_without_length(loader) -> None:
    """Warns for a loader without a length: Lightning then reads one batch ahead (its
    `_PrefetchDataFetcher`, to see the epoch's end), so the state a checkpoint holds is one
    batch past the last trained, and a mid-epoch resume skips that batch (measured: an
    iterable dataset without `__len__`, 4 of 64 samples lost per resume)."""
    try:
        len(loader)
    except TypeError:
        warnings.warn(
            LoaderWarning(
                f"{type(loader).__name__} has no length "
                f"({type(getattr(loader, 'dataset', loader)).__name__} has no __len__): Lightning "
                "reads one batch ahead of it, so a checkpoint taken mid-epoch holds the loader's "
                "state one batch late and the resumed run skips that batch. Checkpoint at epoch "
                "ends, or give the dataset a length."
            ),
            stacklevel=3,
        )


def _ranks(trainer) -> tuple[int, int]:
    if trainer is None:
        return 1, 0
    return int(trainer.world_size), int(trainer.global_rank)


def _epoch_callback():
    """A callback that sets the epoch of what `epoch_holders` finds in the training loaders,
    when it differs: at each epoch's start, and at the start of training (resumed from a
    checkpoint taken at an epoch's last step, Lightning starts the next epoch without
    `on_train_epoch_start`, after the loader's `iter()`)."""
    from lightning.pytorch import Callback

    class SetLoaderEpochs(Callback):
        sets_loader_epochs = True

        def on_train_start(self, trainer, pl_module) -> None:
            _set_epochs(trainer)

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            _set_epochs(trainer)

    return SetLoaderEpochs()


def _set_epochs(trainer) -> None:
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    for loader in loaders:
        for holder in epoch_holders(loader):
            if getattr(holder, "epoch", None) != trainer.current_epoch:
                holder.set_epoch(trainer.current_epoch)


def __getattr__(name: str):
    """`LoaderDataModule`, built on first use so that importing this module imports no Lightning."""
    if name != "LoaderDataModule":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from lightning.pytorch import LightningDataModule
    except ImportError as error:
        raise ImportError(
            'LoaderDataModule needs Lightning: pip install "loader-recipes[lightning]"'
        ) from error
    cls = type(
        "LoaderDataModule",
        (LoaderDataModuleMixin, LightningDataModule),
        {
            "__module__": __name__,
            "__doc__": (
                "A `LightningDataModule` with `LoaderDataModuleMixin`'s methods: its training "
                "loader is `train_loader()` and its checkpoints resume it exactly (module "
                "doc).\n\n" + (LoaderDataModuleMixin.__doc__ or "").split("\n\n", 1)[1]
            ),
        },
    )
    globals()[name] = cls
    return cls
