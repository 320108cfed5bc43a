"""The transformers Trainer's side of `recipes bench hf`: a Trainer that times its resumed
epoch's first batch, with its own data skip or with our loader (`LoaderTrainerMixin`), its
checkpoints, and an epoch of the Trainer's loop over our loader.

Use when: reading how the Trainer's columns and rows of `recipes bench hf` are measured.
Cost: imports transformers at its top (8-20 s); one step of training per checkpoint, one step
per timed resume, one epoch per throughput row.
Adapt here: `trainer_args` (the Trainer's settings), `timed_trainer_classes`.
Trade-off: a checkpoint "at step p" is made by training one step and setting `global_step` to p
in its `trainer_state.json` (the Trainer reads only that to decide what to skip), with the
loader state our loader has after p batches.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from recipes.bench.frameworks.costly_items import Tiny, costly_dataset, our_loader, state_after
from recipes.common.frameworks.accelerate_glue import write_loader_state
from recipes.common.frameworks.hf_trainer_glue import LoaderTrainerMixin


class TimedTrainer(Trainer):
    """A Trainer that trains one step and records the seconds from its epoch's start to its
    first batch (`first_batch_s`)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.first_batch_s = None
        self._asked = None
        outer = self

        class Clock(TrainerCallback):
            def on_epoch_begin(self, *a, **k):
                outer._asked = time.perf_counter()

            def on_step_end(self, args, state, control, **k):
                # one step: the resume's first batch is all we time
                control.should_training_stop = True

        self.add_callback(Clock())

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.first_batch_s is None:
            self.first_batch_s = time.perf_counter() - self._asked
        return super().training_step(model, inputs, num_items_in_batch)


class TimedLoaderTrainer(LoaderTrainerMixin, TimedTrainer):
    """`TimedTrainer` over our loader."""


def trainer(ours: bool, kind: str, n: int, item_us: float, training, args):
    """A timing Trainer over our loader (`LoaderTrainerMixin`) or its own, without its printed
    logs."""
    if ours:
        loader = our_loader(kind, n, item_us, args)
        timed = TimedLoaderTrainer(model=Tiny(), args=training, train_loader=loader)
    else:
        dataset = costly_dataset(kind, n, item_us)
        timed = TimedTrainer(model=Tiny(), args=training, train_dataset=dataset)
    timed.remove_callback(PrinterCallback)  # on when tqdm is off
    return timed


def trainer_args(folder: Path, kind: str, args, **extra):
    length = {"max_steps": args.batches}
    if kind == "map":
        length = {"num_train_epochs": 1}
    return TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=args.batch_size,
        use_cpu=True,
        report_to=[],
        logging_steps=10**9,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=args.workers,
        **length,
        **extra,
    )


def trainer_checkpoint(folder: Path, kind: str, n: int, args, ours: bool) -> Path:
    """A checkpoint after one step, of the Trainer with our loader or with its own."""
    trainer(ours, kind, n, 0.0, trainer_args(folder, kind, args, save_steps=1), args).train()
    return folder / "checkpoint-1"


def trainer_first_after(base: Path, position: int, kind: str, n: int, args, ours: bool) -> float:
    """Seconds to the first batch of a Trainer resumed from `base` made out to be at step
    `position`."""
    run = base.parent / f"{base.parent.name}-at-{position}"
    checkpoint = run / f"checkpoint-{position}"
    shutil.copytree(base, checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["global_step"] = position
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    if ours:
        write_loader_state(
            checkpoint, "train", state_after(kind, n, position, args), rank=0, world_size=1
        )
    resumed = trainer(
        ours, kind, n, args.item_us, trainer_args(run, kind, args, save_strategy="no"), args
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    if ours:
        resumed.train_loader.close()
    return resumed.first_batch_s


class LoaderTrainer(LoaderTrainerMixin, Trainer):
    """The Trainer over our loader."""


def trainer_epoch(loader, folder: Path) -> float:
    """Seconds of one epoch of the Trainer's loop over `loader`, from its epoch's start to its
    end."""
    clock = {}

    class Clock(TrainerCallback):
        def on_epoch_begin(self, *a, **k):
            clock["begin"] = time.perf_counter()

        def on_epoch_end(self, *a, **k):
            clock["end"] = time.perf_counter()

    training = TrainingArguments(
        output_dir=str(folder),
        num_train_epochs=1,
        use_cpu=True,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=0.01,
        max_grad_norm=0.0,
        optim="sgd",
    )
    looped = LoaderTrainer(model=Tiny(), args=training, train_loader=loader, callbacks=[Clock()])
    looped.remove_callback(PrinterCallback)  # its printed logs, on when tqdm is off
    looped.train()
    return clock["end"] - clock["begin"]
