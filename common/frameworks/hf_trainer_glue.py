"""transformers `Trainer` glue: `LoaderTrainerMixin` trains from a recipes loader and resumes it
exactly, at once.

Use when: you train with `transformers.Trainer` (or a subclass: `Seq2SeqTrainer`, TRL's
trainers) and want its batches from a `make_loader` loader (`StatefulLoader`, `ThreadLoader`,
`RobustLoader`, or a `LoaderMonitor` around one), and `trainer.train(resume_from_checkpoint=...)`
to continue at the first batch not trained on, without reading the ones before it:

    class LoaderTrainer(LoaderTrainerMixin, Trainer):
        pass

    trainer = LoaderTrainer(model=model, args=args, train_loader=make_loader(dataset, ...))
    trainer.train(resume_from_checkpoint=True)

Cost: the Trainer's own loop; per batch two `state_dict()` calls of the loader (2-4 us each,
see `accelerate_glue.py`); per checkpoint a ~7 KB JSON file per rank
(`recipes_loader-train.rank<r>.json` beside the Trainer's files).
Adapt here: nothing; the loader carries its settings. `per_device_train_batch_size` only
labels the Trainer's logs (the loader decides the batches).
Trade-off: by default the Trainer resumes by building its loader again and skipping the
batches already trained on (`accelerate.skip_first_batches`: reading and discarding them for
an iterable dataset); that skip is turned off here (`ignore_data_skip=True`, set by the
mixin) because the loader resumes itself. The Trainer then counts a resumed epoch's steps from
the resume point, so with `gradient_accumulation_steps` G > 1 and an epoch whose batch count
G does not divide, the resumed epoch's last partial accumulation is stepped with the next
epoch's first (warned). The loader must be split over the ranks (`accelerate_glue.check_split`).
Copy with: common/frameworks/accelerate_glue.py, common/loader_warning.py.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from transformers import TrainerCallback

from recipes.common.frameworks.accelerate_glue import (
    AcceleratedLoader,
    check_split,
    read_loader_state,
    write_loader_state,
)
from recipes.common.loader_warning import LoaderWarning

__all__ = ["LoaderCheckpoints", "LoaderTrainerMixin", "TrainerLoader"]

NAME = "train"  # the loader's name in a checkpoint folder


class LoaderTrainerMixin:
    """Put before `Trainer` in a subclass's bases: `class LoaderTrainer(LoaderTrainerMixin,
    Trainer)`.

    Args:
        *args, **kwargs: the Trainer's (no `train_dataset` needed).
        train_loader: a recipes loader, split over the ranks when there are several.

    Overrides `get_train_dataloader` (the loader, as `TrainerLoader`) and `train` (loads the
    loader's state from the checkpoint resumed); adds `LoaderCheckpoints`, which writes it.
    """

    def __init__(self, *args: Any, train_loader, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        self.args.ignore_data_skip = (
            True  # the loader resumes itself: no skipping by reading (module doc)
        )
        self._resume_folder: str | None = None
        self._prepared_loader: TrainerLoader | None = None
        self.add_callback(LoaderCheckpoints())

    def get_train_dataloader(self) -> TrainerLoader:
        """The loader, at the checkpoint's place when `train` resumes one."""
        accelerator = self.accelerator
        if self._prepared_loader is None:
            check_split(self.train_loader, accelerator.num_processes, accelerator.process_index)
            # the Trainer moves batches itself (`_prepare_inputs`)
            self._prepared_loader = TrainerLoader(
                self.train_loader, accelerator=accelerator, device_placement=False
            )
        if self._resume_folder is not None:
            state = read_loader_state(
                self._resume_folder,
                NAME,
                rank=accelerator.process_index,
                world_size=accelerator.num_processes,
            )
            self._prepared_loader.load_state_dict(state)
            self._resume_folder = None
        return self._prepared_loader

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """`Trainer.train`; the checkpoint resumed (a folder, or `True`: the last one in
        `output_dir`) also gives the loader's state."""
        folder = resume_from_checkpoint
        if folder is True:
            from transformers.trainer_utils import get_last_checkpoint

            # None: the Trainer raises, naming output_dir
            folder = get_last_checkpoint(self.args.output_dir)
        self._resume_folder = None
        if isinstance(folder, (str, os.PathLike)):
            self._resume_folder = folder
        if self._resume_folder is not None:
            _warn_partial_accumulation(self.train_loader, self.args.gradient_accumulation_steps)
        return super().train(resume_from_checkpoint, *args, **kwargs)


class TrainerLoader(AcceleratedLoader):
    """`AcceleratedLoader` for the Trainer. A loader without a length (an iterable dataset
    under `max_steps`) has its epochs counted from 0 again by a resumed Trainer: the first
    `set_epoch` after a loaded state maps the Trainer's epoch to the state's, and keeps the
    difference."""

    _offset = 0
    _align = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._align = True

    def set_epoch(self, epoch: int) -> None:
        if self._align:
            self._offset = self.epoch - epoch
            self._align = False
        super().set_epoch(epoch + self._offset)


class LoaderCheckpoints(TrainerCallback):
    """Writes the train loader's state into each checkpoint folder the Trainer saves, one file
    per rank (`on_save` runs on every rank)."""

    def on_save(self, args, state, control, train_dataloader=None, **kwargs):
        if train_dataloader is None or not callable(getattr(train_dataloader, "state_dict", None)):
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        write_loader_state(
            folder,
            NAME,
            train_dataloader.state_dict(),
            rank=args.process_index,
            world_size=args.world_size,
        )


def _warn_partial_accumulation(loader, accumulation: int) -> None:
    try:
        batches = len(loader)
    except TypeError:  # no length: the Trainer runs by max_steps
        return
    if accumulation > 1 and batches % accumulation:
        warnings.warn(
            f"gradient_accumulation_steps={accumulation} does not divide the loader's {batches} "
            "batches per epoch: the Trainer counts a resumed epoch's steps from the resume point, "
            f"so that epoch's last {batches % accumulation} batches are stepped with the next "
            "epoch's first instead of alone. Make the batches per epoch a multiple of it "
            "(drop_last=True, or the batch size) for a resume that equals the uninterrupted run.",
            LoaderWarning,
            stacklevel=3,
        )
