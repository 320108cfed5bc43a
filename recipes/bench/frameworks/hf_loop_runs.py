"""The measurements behind `recipes bench hf` (`hf_loops.py`): the resume and loop timings, apart
so that building the command line imports no torch."""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset


def _burn(microseconds: float) -> None:
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        pass


def _item(i: int, total: int) -> dict:
    return {
        "x": torch.tensor([i / total, (i % 7) / 7]),
        "labels": torch.tensor([float(i % 3)]),
        "idx": i,
    }


class CostlyItems(Dataset):
    """Map-style: item i costs `item_us` of CPU (or, `wait=True`, of waiting, as on storage),
    then a dict of small tensors."""

    def __init__(self, n: int, item_us: float, *, wait: bool = False):
        self.n = n
        self.item_us = item_us
        self.wait = wait

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.wait:
            time.sleep(self.item_us / 1e6)
        else:
            _burn(self.item_us)
        return _item(i, self.n)


def read_costly_shard(
    name: str, start: int = 0, stop: int | None = None, *, size: int, total: int, item_us: float
):
    """A virtual shard of `size` items (shard `name` holds items name * size ...)."""
    first = int(name) * size
    for i in range(first + start, first + (size if stop is None else stop)):
        _burn(item_us)
        yield _item(i, total)


def _dataset(kind: str, n: int, item_us: float):
    if kind == "map":
        return CostlyItems(n, item_us)
    from recipes.common import ShardedIterableDataset

    size = 64
    shards = [str(s) for s in range(-(-n // size))]
    lengths = [min(size, n - size * s) for s in range(len(shards))]
    read = functools.partial(read_costly_shard, size=size, total=n, item_us=item_us)
    return ShardedIterableDataset(shards, read, shard_lengths=lengths, seed=0, rank=0, world_size=1)


def _our_loader(kind: str, n: int, item_us: float, args):
    from recipes.common import make_loader

    torch.manual_seed(0)
    shuffle = {"shuffle": True} if kind == "map" else {}
    return make_loader(
        _dataset(kind, n, item_us),
        batch_size=args.batch_size,
        num_workers=args.workers,
        path="workers",
        **shuffle,
    )


def _state_after(kind: str, n: int, batches: int, args) -> dict:
    """Our loader's state after `batches` batches, read at zero cost per item."""
    loader = _our_loader(kind, n, 0.0, args)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    del iterator
    loader.close()
    return json.loads(json.dumps(state))  # what a checkpoint file gives back


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, labels, idx=None):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


# ---- the time to the first batch after a resume -----------------------------------------
def _time_first(begin) -> float:
    """Seconds from calling `begin()` (which returns an iterator) to its first item."""
    start = time.perf_counter()
    iterator = begin()
    next(iterator)
    took = time.perf_counter() - start
    del iterator  # its workers end now
    return took


def _first_after_ours(accelerator, kind, n, state, args) -> float:
    from recipes.common.frameworks.accelerate_glue import AcceleratedLoader

    loader = _our_loader(kind, n, args.item_us, args)
    wrapped = AcceleratedLoader(loader, accelerator=accelerator)
    took = _time_first(lambda: (wrapped.load_state_dict(state), iter(wrapped))[1])
    loader.close()
    return took


def _first_after_skip(accelerator, kind, n, skip, args) -> float:
    torch.manual_seed(0)
    shuffle = {"shuffle": True} if kind == "map" else {}
    prepared = accelerator.prepare_data_loader(
        DataLoader(
            _dataset(kind, n, args.item_us),
            batch_size=args.batch_size,
            num_workers=args.workers,
            **shuffle,
        )
    )
    return _time_first(lambda: iter(accelerator.skip_first_batches(prepared, skip)))


def _trainer_classes():
    """(a Trainer timing its resumed epoch's first batch, the same with our loader)."""
    from transformers import Trainer, TrainerCallback

    from recipes.common.frameworks.hf_trainer_glue import LoaderTrainerMixin

    class Timed(Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.first_batch_s = None
            self._asked = None
            outer = self

            class Clock(TrainerCallback):
                def on_epoch_begin(self, *a, **k):
                    outer._asked = time.perf_counter()

                def on_step_end(self, args, state, control, **k):
                    control.should_training_stop = (
                        True  # one step: the resume's first batch is all we time
                    )

            self.add_callback(Clock())

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.first_batch_s is None:
                self.first_batch_s = time.perf_counter() - self._asked
            return super().training_step(model, inputs, num_items_in_batch)

    class TimedLoader(LoaderTrainerMixin, Timed):
        pass

    return Timed, TimedLoader


def _trainer(ours: bool, kind: str, n: int, item_us: float, training, args):
    """A timing Trainer over our loader (`LoaderTrainerMixin`) or its own, without its printed
    logs."""
    from transformers.trainer_callback import PrinterCallback

    timed, timed_loader = _trainer_classes()
    if ours:
        trainer = timed_loader(
            model=Tiny(), args=training, train_loader=_our_loader(kind, n, item_us, args)
        )
    else:
        trainer = timed(model=Tiny(), args=training, train_dataset=_dataset(kind, n, item_us))
    trainer.remove_callback(PrinterCallback)  # on when tqdm is off
    return trainer


def _trainer_args(folder: Path, kind: str, args, **extra):
    from transformers import TrainingArguments

    length = {"num_train_epochs": 1} if kind == "map" else {"max_steps": args.batches}
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


def _trainer_checkpoint(folder: Path, kind: str, n: int, args, ours: bool) -> Path:
    """A checkpoint after one step, of the Trainer with our loader or with its own."""
    _trainer(ours, kind, n, 0.0, _trainer_args(folder, kind, args, save_steps=1), args).train()
    return folder / "checkpoint-1"


def _trainer_first_after(base: Path, position: int, kind: str, n: int, args, ours: bool) -> float:
    from recipes.common.frameworks.accelerate_glue import write_loader_state

    run = base.parent / f"{base.parent.name}-at-{position}"
    checkpoint = run / f"checkpoint-{position}"
    shutil.copytree(base, checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["global_step"] = position
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    if ours:
        write_loader_state(
            checkpoint, "train", _state_after(kind, n, position, args), rank=0, world_size=1
        )
    trainer = _trainer(
        ours, kind, n, args.item_us, _trainer_args(run, kind, args, save_strategy="no"), args
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    if ours:
        trainer.train_loader.close()
    return trainer.first_batch_s


def resume_rows(accelerator, args, folder: Path) -> list[list[str]]:
    n = args.batches * args.batch_size
    positions = [max(1, round(float(p) * args.batches)) for p in args.positions.split(",")]
    rows = []
    for kind in ("map", "iterable"):
        bases = {
            ours: _trainer_checkpoint(folder / f"{kind}-{ours}", kind, n, args, ours)
            for ours in (True, False)
        }
        for position in positions:
            state = _state_after(kind, n, position, args)
            cells = [
                _first_after_ours(accelerator, kind, n, state, args),
                _first_after_skip(accelerator, kind, n, position, args),
                _trainer_first_after(bases[True], position, kind, n, args, ours=True),
                _trainer_first_after(bases[False], position, kind, n, args, ours=False),
            ]
            rows.append([kind, f"{position:,} of {args.batches:,}", *(f"{c:.3f}" for c in cells)])
    return rows


# ---- throughput: the same loader in a plain loop, accelerate's and the Trainer's ----------
def _step_epoch(batches, model, optimizer, backward) -> float:
    start = time.perf_counter()
    for batch in batches:
        backward(model(**batch)["loss"])
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def _accelerate_epoch(accelerator, loader, name: str, glue: bool = True) -> float:
    """An epoch of accelerate's step over `loader`, through `prepare_loader` (or, `glue=False`,
    iterated as it is: on CPU the batches are where the model is)."""
    from recipes.common.frameworks.accelerate_glue import prepare_loader

    model = Tiny()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    prepared = prepare_loader(accelerator, loader, name=name) if glue else loader
    return _step_epoch(prepared, model, optimizer, accelerator.backward)


def _trainer_epoch(loader, folder: Path) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from recipes.common.frameworks.hf_trainer_glue import LoaderTrainerMixin

    clock = {}

    class Clock(TrainerCallback):
        def on_epoch_begin(self, *a, **k):
            clock["begin"] = time.perf_counter()

        def on_epoch_end(self, *a, **k):
            clock["end"] = time.perf_counter()

    class LoaderTrainer(LoaderTrainerMixin, Trainer):
        pass

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
    trainer = LoaderTrainer(model=Tiny(), args=training, train_loader=loader, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its printed logs, on when tqdm is off
    trainer.train()
    return clock["end"] - clock["begin"]


def _loop_epoch(
    loop: str, accelerator, items: CostlyItems, workers: int, args, folder: Path, tag: str
) -> float:
    """Seconds of one epoch of `loop` (a key of `LOOPS`) over a fresh loader."""
    from recipes.common import make_loader

    torch.manual_seed(0)
    loader = make_loader(
        items, batch_size=args.batch_size, shuffle=True, num_workers=workers, path="workers"
    )
    if loop == "plain":
        model = Tiny()
        took = _step_epoch(
            loader, model, torch.optim.SGD(model.parameters(), lr=0.01), torch.Tensor.backward
        )
    elif loop.startswith("accelerate"):
        took = _accelerate_epoch(accelerator, loader, f"loop-{tag}", glue=loop == "accelerate")
    else:
        took = _trainer_epoch(loader, folder / f"loop-{tag}")
    loader.close()
    return took


LOOPS = {
    "plain": "plain loop",
    "accelerate": "accelerate (`prepare_loader`)",
    "accelerate-bare": "accelerate's step, the loader iterated bare (no glue)",
    "trainer": "transformers Trainer (`LoaderTrainerMixin`)",
}


def throughput_rows(accelerator, args, folder: Path) -> list[list[str]]:
    """Per loop and kind of loader (items that wait, as on storage; items that compute): the
    best epoch's samples/s of `args.repeats`, taken in turns, against the plain loop's."""
    n = args.loop_batches * args.batch_size
    # (items wait, cost per item, workers); "instant": the loop's own cost per step, items made
    # in-process
    kinds = {
        "waits (I/O-bound)": (True, args.loop_item_us, args.workers),
        "computes (CPU-bound)": (False, args.loop_item_us, args.workers),
        "instant": (False, 0.0, 0),
    }
    best = {(kind, loop): float("inf") for kind in kinds for loop in LOOPS}
    for loop in LOOPS:  # a first epoch of each, not counted: first calls, allocator, page cache
        _loop_epoch(
            loop,
            accelerator,
            CostlyItems(n // 4, args.loop_item_us),
            args.workers,
            args,
            folder,
            "warm-up",
        )
    for repeat in range(
        args.repeats
    ):  # in turns, so that a slow spell of the machine hits every loop
        for kind, (wait, cost, workers) in kinds.items():
            for loop in LOOPS:
                took = _loop_epoch(
                    loop,
                    accelerator,
                    CostlyItems(n, cost, wait=wait),
                    workers,
                    args,
                    folder,
                    f"{repeat}-{kind[:5]}",
                )
                best[kind, loop] = min(best[kind, loop], took)
    return [
        [
            kind,
            label,
            f"{n / best[kind, loop]:,.0f}",
            f"{best[kind, 'plain'] / best[kind, loop]:.1%}",
            f"{1000 * best['instant', loop] / args.loop_batches:.2f}",
        ]
        for kind in list(kinds)[:2]
        for loop, label in LOOPS.items()
    ]


def glue_cost(accelerator, args) -> tuple[float, float]:
    """(us per batch iterating the loader directly, through `AcceleratedLoader`): instant items,
    no workers, best of 3 in turns."""
    from recipes.common import make_loader
    from recipes.common.frameworks.accelerate_glue import AcceleratedLoader

    best = [float("inf"), float("inf")]
    for _ in range(3):
        for wrapped in (False, True):
            loader = make_loader(
                CostlyItems(args.loop_batches * args.batch_size, 0.0),
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=0,
            )
            iterable = AcceleratedLoader(loader, accelerator=accelerator) if wrapped else loader
            start = time.perf_counter()
            for _batch in iterable:
                pass
            best[wrapped] = min(
                best[wrapped], (time.perf_counter() - start) / args.loop_batches * 1e6
            )
    return best[0], best[1]
