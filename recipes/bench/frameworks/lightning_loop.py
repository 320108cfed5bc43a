"""`recipes bench lightning`: our loader inside Lightning's training loop against our own loop, and
the time a resumed run waits for its first batch.

Use when: checking what Lightning's loop costs a `make_loader` loader (samples/s of the same
loader, model and step in our plain loop and in `Trainer.fit`, in turns), and that a resume
starts at once wherever in the epoch the checkpoint was taken.
Cost: a synthetic map-style dataset whose samples cost `--item-us` of CPU each (busy work in
`__getitem__`, a stand-in for decoding) and a tiny MLP; `--repeat` turns of (`--epochs` plain
epochs, one `fit` of `--epochs` epochs), at the loader's pace (`--workers` workers) and at the
loop's pace (free samples, no workers: what the loop itself costs per step); then, per resume
position, a checkpoint made on free samples, and three waits for the first batch:
`load_state_dict` + `next`, `Trainer.fit(ckpt_path=)` to the first `training_step`, and the
baseline that skips by reading and dropping batches.
Adapt here: `--item-us`, `--batch-size`, `--workers`, `--resume-samples` (the epoch the
resume positions are taken in: the baseline's wait grows with it, ours does not).
Trade-off: rates are per epoch from the second epoch on (the first holds worker start-up and,
in Lightning, an `iter()` before `on_train_epoch_start`); the best epoch of each loop is
compared, the median printed beside it. The loader is `LoaderDataModule`'s in both loops.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

# its `LoaderDataModule` is built on first use (it imports Lightning): read where it is called
from recipes.common.frameworks import lightning_glue


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=2048, help="samples per epoch (throughput)")
    parser.add_argument(
        "--resume-samples", type=int, default=4096, help="samples per epoch (time to resume)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--item-us",
        type=float,
        default=1000.0,
        help="CPU microseconds per sample (1 ms: a small JPEG's decode and crop)",
    )
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per turn (the first is not counted)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="turns of each loop")


class _Work:
    """Sample i: 256 float32 values drawn from seed i, after `item_us` of busy CPU work."""

    def __init__(self, n: int, item_us: float):
        self.n = n
        self.item_us = item_us

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import numpy as np
        import torch

        end = time.perf_counter() + self.item_us * 1e-6
        values = torch.from_numpy(
            np.random.default_rng(index).standard_normal(256, dtype=np.float32)
        )
        while time.perf_counter() < end:
            pass
        return values, index


def _model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _loss(model, batch):
    x, ids = batch
    return model(x).logsumexp(dim=1).mean() + 0 * ids.sum()


def _loader_kwargs(args, seed: int = 0) -> dict:
    import torch

    return dict(
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(seed),
    )


def _loader(dataset, args, seed: int = 0):
    """The loader `LoaderDataModule` builds (outside a trainer: one rank): `make_loader` over a
    `DistributedSampler` (one rank), the same in both loops."""

    return lightning_glue.LoaderDataModule(dataset, **_loader_kwargs(args, seed)).train_loader()


def _plain_rates(args) -> list[float]:
    """Samples/s of each epoch after the first, our loop: forward, backward, step."""
    import torch

    model = _model()
    loader = _loader(_Work(args.samples, args.item_us), args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rates = []
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        seen = 0
        for batch in loader:
            loss = _loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(batch[1])
        if epoch:
            rates.append(seen / (time.perf_counter() - start))
    loader.close()
    return rates


def _module(first_step: list | None = None):
    """A LightningModule with `_loss`'s step; `first_step` gets the time of its first step."""
    import lightning.pytorch as pl
    import torch

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, index):
            if first_step is not None and not first_step:
                first_step.append(time.perf_counter())
            return _loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def _trainer(epochs: int, callbacks=(), **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kwargs,
    )


def _lightning_rates(args) -> list[float]:
    """Samples/s of each epoch after the first inside `Trainer.fit` (on_train_epoch_start to
    on_train_epoch_end: the epoch's `iter()` is inside from the second epoch on)."""
    import lightning.pytorch as pl

    marks: list[tuple[float, float]] = []

    class Clock(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            marks.append((self.start, time.perf_counter()))

    data = lightning_glue.LoaderDataModule(
        _Work(args.samples, args.item_us), **_loader_kwargs(args)
    )
    _trainer(args.epochs, [Clock()]).fit(_module(), datamodule=data)
    data.loader.close()
    return [args.samples / (end - start) for start, end in marks[1:]]


def _checkpoint(args, dataset, position: int, path: Path) -> None:
    """A Lightning checkpoint after `position` batches of epoch 1 (at epoch 0's end for 0), read
    for free (`item_us` 0 meanwhile)."""
    import lightning.pytorch as pl

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            if (trainer.current_epoch, index + 1) in (
                (1, position),
                (0, len(trainer.train_dataloader) * (not position)),
            ):
                trainer.save_checkpoint(path)
                trainer.should_stop = True

    cost = dataset.item_us
    dataset.item_us = 0.0
    data = lightning_glue.LoaderDataModule(dataset, **_loader_kwargs(args))
    _trainer(2, [Save()]).fit(_module(), datamodule=data)
    data.loader.close()
    dataset.item_us = cost


def _resume_waits(args, positions: list[int], folder: Path) -> list[tuple[float, float, float]]:
    """Per position p of epoch 1: (ours: `load_state_dict` -> first batch; ours in Lightning:
    `fit(ckpt_path)` -> first `training_step`; the baseline: `iter` -> batch p, read after
    reading and dropping the p before it)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    class StopAtOnce(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            trainer.should_stop = True

    dataset = _Work(args.resume_samples, args.item_us)
    waits = []
    for position in positions:
        saved = folder / f"at-{position}.ckpt"
        _checkpoint(args, dataset, position, saved)
        state = torch.load(saved, weights_only=False)["LoaderDataModule"]["train_loader"]
        ours = _loader(dataset, args, seed=1)
        start = time.perf_counter()
        ours.load_state_dict(state)
        ours.sampler.set_epoch(
            1
        )  # as the loop does: epoch 1 (position 0: the state is epoch 0's end)
        next(iter(ours))
        first_ours = time.perf_counter() - start
        ours.close()
        first: list[float] = []
        resumed = lightning_glue.LoaderDataModule(dataset, **_loader_kwargs(args))
        start = time.perf_counter()
        _trainer(2, [StopAtOnce()]).fit(_module(first), datamodule=resumed, ckpt_path=saved)
        resumed.loader.close()
        first_lightning = first[0] - start
        baseline = DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            generator=torch.Generator().manual_seed(0),
        )
        start = time.perf_counter()
        batches = iter(baseline)
        for _ in range(position + 1):  # drop the first p batches, read batch p
            next(batches)
        first_baseline = time.perf_counter() - start
        del batches
        waits.append((first_ours, first_lightning, first_baseline))
    return waits


def run(args: argparse.Namespace) -> int:
    import logging

    import lightning.pytorch  # noqa: F401 (it sets its loggers' levels at import: quieted after)

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*(does not have many workers|weights_only).*")
    import torch

    torch.set_num_threads(
        1
    )  # the step's own threads would contend with the worker for 2 cores: both loops alike
    free = argparse.Namespace(**{**vars(args), "item_us": 0.0, "workers": 0})  # the loop alone
    rates: dict[str, tuple[list[float], list[float]]] = {"bound": ([], []), "free": ([], [])}
    turns: dict[str, list[float]] = {"bound": [], "free": []}  # each turn's ratio of median epochs
    for _ in range(args.repeat):  # in turns: a machine's slow spell lands on both loops
        for key, setting in (("bound", args), ("free", free)):
            plain = _plain_rates(setting)
            lightning = _lightning_rates(setting)
            rates[key][0].extend(plain)
            rates[key][1].extend(lightning)
            turns[key].append(statistics.median(lightning) / statistics.median(plain))
    best = {key: (max(plain), max(lightning)) for key, (plain, lightning) in rates.items()}
    median = {
        key: (statistics.median(plain), statistics.median(lightning))
        for key, (plain, lightning) in rates.items()
    }
    ratio = {key: statistics.median(values) for key, values in turns.items()}
    print(
        f"\n## lightning: {args.samples:,} samples, batch {args.batch_size}, a 256-256-10 MLP on "
        f"CPU (1 thread), samples/s: best (median) of {len(rates['bound'][0])} epochs per loop, in "
        f"{args.repeat} turns\n"
    )
    print(
        f"| loop | {args.item_us:g} us samples, {args.workers} workers (the loader's pace) "
        "| no busy work, no workers (the loop's pace) |\n|---|---:|---:|"
    )
    for label, k in (
        ("plain loop (our for-loop)", 0),
        ("Lightning loop (LoaderDataModule, Trainer.fit)", 1),
    ):
        print(
            f"| {label} | "
            + " | ".join(
                f"{best[key][k]:,.0f} ({median[key][k]:,.0f})" for key in ("bound", "free")
            )
            + " |"
        )
    print(
        "| ratio (Lightning / plain): median of the turns' (best epochs) | "
        + " | ".join(
            f"{ratio[key]:.3f} ({best[key][1] / best[key][0]:.3f})" for key in ("bound", "free")
        )
        + " |"
    )
    per_step = {
        key: (1 / median[key][1] - 1 / median[key][0]) * args.batch_size * 1e6 for key in median
    }
    verdict = "within" if ratio["bound"] >= 0.97 else "beyond"
    print(
        f"\nAt the loader's pace Lightning's loop is {verdict} 3% of ours (median of the turns); "
        f"at the loop's pace it costs {per_step['free']:,.0f} us per step more than our for-loop "
        "(median epochs)."
    )
    per_epoch = args.resume_samples // args.batch_size
    positions = [0, per_epoch // 2, per_epoch - max(1, per_epoch // 20)]
    with tempfile.TemporaryDirectory(prefix="recipes-bench-lightning-") as folder:
        waits = _resume_waits(args, positions, Path(folder))
    print(
        f"\n## time to the first batch of a resumed run, epoch 1 of {per_epoch} batches "
        f"({args.resume_samples:,} samples of {args.item_us:g} us, {args.workers} workers)\n"
    )
    print("| resumed at batch | " + " | ".join(str(p) for p in positions) + " |")
    print("|---|" + "---:|" * len(positions))
    for label, column in (
        ("ours: load_state_dict -> first batch (s)", 0),
        ("ours in Lightning: fit(ckpt_path) -> first step (s)", 1),
        ("skip by iterating: read and drop, then the batch (s)", 2),
    ):
        print(f"| {label} | " + " | ".join(f"{w[column]:.2f}" for w in waits) + " |")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
