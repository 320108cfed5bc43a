"""Audio classification training with Lightning and the recipes: a complete script to copy and
adapt.

    recipes template audio --framework lightning > train.py
    python train.py --audio /data/recordings --cache /nvme/mels
    torchrun --nproc_per_node=8 train.py --audio /data/recordings --cache /nvme/mels
    python train.py --smoke            # generated recordings, a tiny CNN: about a minute on 2 CPUs

What to change for your data (lines marked ADAPT):
  - `label_of`: your labels (here: the recording's index, modulo the classes).
  - `build_model`: your network (a small CNN on log-mels).
  - `--audio` (a folder of WAV/FLAC/OGG), `--cache` (the spectrogram cache), `CHUNK_SECONDS`,
    `SAMPLE_RATE`, the mel settings in `build_spectrogram_cache(...)`.
  - `--max-frames`: padded feature frames per batch per rank; the optimiser and its schedule.
What Lightning gets from the recipes (docs/frameworks/lightning.md):
  - `LoaderDataModule`: its `train_loader()` builds the `make_loader` loader over duration-bucketed
    batches, and Lightning's checkpoints (`checkpoints/checkpoint.ckpt`, every
    `--checkpoint-every` steps) resume it at the first batch not trained, in the same order, on
    every rank; also with OneCycleLR, which reads `trainer.estimated_stepping_batches` (there
    Lightning alone loses the loader's place: Lightning #20550). Run the same command again to
    resume.
  - `use_distributed_sampler=False`: `LengthBucketSampler` deals the batches over the ranks
    itself; `LoaderDataModule` calls its `set_epoch` at each epoch, which Lightning does not
    for a batch sampler.
  - The rest is the plain template's (`recipes template audio`): chunked windows, the log-mel
    cache (read by threads), `pad_collate`.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache, pad_collate
from recipes.common import LengthBucketSampler, make_loader
from recipes.common.frameworks.lightning_glue import LoaderDataModule
from recipes.testing import make_audio_files

CHUNK_SECONDS = 4.0  # ADAPT: the window length (None: one item per recording)
SAMPLE_RATE = 16000  # ADAPT: every file is resampled to this rate
CLASSES = 10  # ADAPT


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--audio", type=Path, help="a folder of audio files (searched recursively)")
    parser.add_argument("--cache", type=Path, help="the spectrogram cache's folder")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs/audio"), help="checkpoints and logs"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--max-frames", type=int, default=64 * 401, help="padded frames per batch per rank"
    )
    parser.add_argument("--lr", type=float, default=0.01, help="OneCycleLR's peak")
    parser.add_argument(
        "--checkpoint-every", type=int, default=500, help="steps between checkpoints"
    )
    parser.add_argument("--smoke", action="store_true", help="generated data and a tiny model")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="exit after N steps (a simulated crash)"
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="log the (file, start) of every window"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
        args.max_frames = 4 * 101
        args.checkpoint_every = 1
    elif args.audio is None or args.cache is None:
        parser.error("--audio and --cache are required (or --smoke)")
    return args


def label_of(batch) -> torch.Tensor:
    """ADAPT: the targets of a batch (here: the file index, modulo the classes)."""
    return batch["file"] % CLASSES


def build_model(n_mels: int, smoke: bool) -> torch.nn.Module:
    """ADAPT: your network; input `[B, 1, n_mels, frames]`."""
    widths = (4, 8) if smoke else (64, 128, 256)
    layers = []
    channels = 1
    for width in widths:
        layers += [
            torch.nn.Conv2d(channels, width, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(),
        ]
        channels = width
    return torch.nn.Sequential(
        *layers,
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(channels, CLASSES),
    )


class Recordings(LoaderDataModule):
    """The spectrogram cache of chunked windows (features computed by every rank's share) and the
    loader."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.n_mels = 40 if args.smoke else 80

    def prepare_data(self) -> None:  # once per node, before setup
        if self.args.smoke and not (self.args.audio / ".complete").exists():
            make_audio_files(
                self.args.audio, count=6, seconds=[4.0, 6.5, 3.2, 8.0, 5.1, 2.4], seed=0
            )
            (self.args.audio / ".complete").touch()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        chunk = 1.0 if self.args.smoke else CHUNK_SECONDS
        windows = ChunkedAudioDataset(
            self.args.audio, chunk_seconds=chunk, sample_rate=SAMPLE_RATE, last_chunk="keep"
        )
        self.dataset = build_spectrogram_cache(
            windows, self.args.cache, n_mels=self.n_mels, distributed=self.trainer.world_size > 1
        )

    def train_loader(self):
        # the ranks come from torch.distributed: each rank gets its share of the bucketed batches
        sampler = LengthBucketSampler(self.dataset.lengths, max_tokens=self.args.max_frames, seed=0)
        return make_loader(self.dataset, batch_sampler=sampler, collate_fn=pad_collate)


class Classifier(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.log_file = None
        self.started = 0.0
        self.loss = None

    def setup(self, stage: str) -> None:
        self.model = build_model(self.trainer.datamodule.n_mels, self.args.smoke)
        if (
            self.trainer.world_size > 1 and self.device.type == "cuda"
        ):  # batch statistics over every rank's windows
            self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        if self.args.log_samples:
            self.log_file = open(self.args.workdir / f"samples-rank{self.global_rank}.txt", "a")  # noqa: SIM115

    def on_train_start(self) -> None:  # a resumed epoch has no on_train_epoch_start
        self.started = time.perf_counter()

    def on_train_epoch_start(self) -> None:
        self.started = time.perf_counter()

    def training_step(self, batch, index):
        mels = batch["inputs"].float().unsqueeze(1)  # [B, 1, n_mels, T]
        loss = torch.nn.functional.cross_entropy(self.model(mels), label_of(batch))
        self.loss = loss.detach()
        if self.log_file is not None:
            self.log_file.write(
                " ".join(
                    f"{f}:{s:.3f}"
                    for f, s in zip(batch["file"].tolist(), batch["start"].tolist(), strict=True)
                )
                + "\n"
            )
            self.log_file.flush()
        return loss

    def on_train_batch_end(
        self, outputs, batch, index
    ) -> None:  # after the checkpoint callback saved
        if self.args.stop_after is not None and self.trainer.global_step >= self.args.stop_after:
            self.trainer.strategy.barrier("stop")
            os._exit(0)  # a simulated crash: no clean-up, as a killed job

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:  # a resume at an epoch's end has no batch left: no loss
            loss = "-"
            if self.loss is not None:
                loss = f"{self.loss.item():.3f}"
            print(
                f"epoch {self.current_epoch}: {time.perf_counter() - self.started:.1f} s, loss "
                f"{loss}",
                flush=True,
            )

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=0.9)
        # ADAPT: the schedule; reading estimated_stepping_batches sets the training loader up now
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.args.lr, total_steps=int(steps)
        )
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.audio = args.workdir / "audio"
        args.cache = args.workdir / "mels"
    args.workdir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    devices = int(
        os.environ.get("LOCAL_WORLD_SIZE", 1)
    )  # torchrun's processes on this node (Lightning joins them)
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // devices
    checkpoints = ModelCheckpoint(
        dirpath=args.workdir / "checkpoints",
        filename="checkpoint",
        every_n_train_steps=args.checkpoint_every,
        enable_version_counter=False,
    )
    strategy = "auto"
    if devices * nodes > 1:
        strategy = "ddp"
    precision = "32-true"
    if torch.cuda.is_available():
        precision = "bf16-mixed"
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="auto",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        callbacks=[checkpoints],
        use_distributed_sampler=False,  # LengthBucketSampler splits the batches over the ranks
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = args.workdir / "checkpoints" / "checkpoint.ckpt"
    if not resume.exists():
        resume = None
    started = time.perf_counter()
    trainer.fit(Classifier(args), datamodule=Recordings(args), ckpt_path=resume)
    if trainer.global_rank == 0:
        print(
            f"trained to epoch {trainer.current_epoch} in {time.perf_counter() - started:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
