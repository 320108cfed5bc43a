"""Image classification training with Lightning and the recipes: a complete script to copy and
adapt.

    recipes template vision --framework lightning > train.py
    python train.py --data /data/train --cache /nvme/recipes-cache
    torchrun --nproc_per_node=8 train.py --data /data/train --cache /nvme/recipes-cache
    python train.py --smoke            # generated images, a tiny model: about a minute on 2 CPUs

What to change for your data (lines marked ADAPT):
  - `build_model`: your network (torchvision's resnet50 here; a tiny CNN with --smoke).
  - `--data` (an ImageFolder tree, root/<class>/<image>) and `--cache` (fast local disk).
  - `SIZE`, the progressive schedule, the optimiser and its OneCycleLR schedule.
What Lightning gets from the recipes (docs/frameworks/lightning.md):
  - `LoaderDataModule`: its `train_loader()` builds the `make_loader` loader, and Lightning's
    checkpoints (`checkpoints/checkpoint.ckpt`, every `--checkpoint-every` steps) resume it at
    the first batch not trained, in the same order, on every rank; also with OneCycleLR, which
    reads `trainer.estimated_stepping_batches` (there Lightning alone loses the loader's place:
    Lightning #20550). Run the same command again to resume.
  - The `ElasticDistributedSampler` (a `DistributedSampler`) is built here, so Lightning keeps
    the loader as it is (`use_distributed_sampler` stays on), and a checkpoint resumes on any
    number of ranks.
  - The rest is the plain template's (`recipes template vision`): the decoded cache (threads read
    its batches), uint8 batches normalised on the device, progressive resolution.
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

from recipes.common import ElasticDistributedSampler, make_loader
from recipes.common.frameworks.lightning_glue import LoaderDataModule
from recipes.testing import make_image_folder
from recipes.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DeviceNormalize,
    ImageFolderFast,
    ProgressiveResolution,
    build_image_cache,
    uint8_collate,
)

SIZE = 224  # ADAPT: the training resolution (the schedule ends here)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="ImageFolder root (root/<class>/<image>)")
    parser.add_argument("--cache", type=Path, help="folder for the decoded-image cache")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs/vision"), help="checkpoints and logs"
    )
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="OneCycleLR's peak")
    parser.add_argument(
        "--checkpoint-every", type=int, default=500, help="steps between checkpoints"
    )
    parser.add_argument("--smoke", action="store_true", help="generated data and a tiny model")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="exit after N steps (a simulated crash)"
    )
    parser.add_argument("--log-samples", action="store_true", help="log the targets of every step")
    args = parser.parse_args(argv)
    if args.smoke:  # 48 classes of one image each: a target names its image
        args.epochs = 2
        args.batch_size = 4
        args.checkpoint_every = 1
    elif args.data is None or args.cache is None:
        parser.error("--data and --cache are required (or --smoke)")
    return args


def build_model(num_classes: int, smoke: bool) -> torch.nn.Module:
    """ADAPT: your network."""
    if smoke:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, num_classes),
        )
    import torchvision

    return torchvision.models.resnet50(weights=None, num_classes=num_classes)


class Images(LoaderDataModule):
    """The dataset, its decoded cache (built once, split over the ranks) and the training loader."""

    def __init__(self, args):
        super().__init__()
        self.args = args

    def prepare_data(self) -> None:  # once per node, before setup
        if self.args.smoke and not (self.args.data / ".complete").exists():
            make_image_folder(self.args.data, classes=48, per_class=1, size=(160, 120), seed=0)
            (self.args.data / ".complete").touch()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        args = self.args
        world = self.trainer.world_size
        self.dataset = ImageFolderFast(
            args.data,
            size=64 if args.smoke else SIZE,
            train=True,
            cache_dir=args.cache,
            on_error="skip",
        )
        # every rank makes this call: the ranks split the decoding, each node's folder ends with the
        # cache
        build_image_cache(self.dataset, args.cache, distributed=world > 1)
        self.schedule = ProgressiveResolution(
            start=48 if args.smoke else 160,
            end=self.dataset.size[0],
            start_epoch=0,
            end_epoch=max(0, args.epochs - 2),
        )

    def train_loader(self):
        self.schedule.apply(
            self.dataset, self.start_epoch
        )  # later epochs: Classifier.on_train_epoch_start
        sampler = ElasticDistributedSampler(
            self.dataset,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            shuffle=True,
            seed=0,
            drop_last=True,
        )
        return make_loader(
            self.dataset,
            batch_size=self.args.batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=uint8_collate,
        )


class Classifier(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.log_file = None
        self.started = 0.0
        self.loss = None

    def setup(self, stage: str) -> None:  # after the DataModule's: the classes are known
        self.model = build_model(len(self.trainer.datamodule.dataset.classes), self.args.smoke)
        self.model.to(self.device, memory_format=torch.channels_last)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.normalize = DeviceNormalize(
            IMAGENET_MEAN, IMAGENET_STD, device=self.device, dtype=dtype, channels_last=True
        )
        if self.args.log_samples:
            self.log_file = open(self.args.workdir / f"samples-rank{self.global_rank}.txt", "a")  # noqa: SIM115

    def on_train_start(self) -> None:  # a resumed epoch has no on_train_epoch_start
        self.started = time.perf_counter()

    def on_train_epoch_start(self) -> None:
        data = self.trainer.datamodule
        data.schedule.apply(
            data.dataset, self.current_epoch
        )  # reaches persistent workers (shared memory)
        self.started = time.perf_counter()

    def training_step(self, batch, index):
        images, targets = self.normalize(*batch)
        loss = torch.nn.functional.cross_entropy(self.model(images), targets)
        self.loss = loss.detach()
        if self.log_file is not None:
            self.log_file.write(" ".join(map(str, targets.tolist())) + "\n")
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
                f"{loss}, resolution {self.trainer.datamodule.dataset.resolution[0]}",
                flush=True,
            )

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(
            self.parameters(), lr=self.args.lr, momentum=0.9, weight_decay=5e-5
        )
        # ADAPT: the schedule; reading estimated_stepping_batches sets the training loader up now
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.args.lr, total_steps=int(steps)
        )
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.data = args.workdir / "data"
        args.cache = args.workdir / "cache"
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
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = args.workdir / "checkpoints" / "checkpoint.ckpt"
    if not resume.exists():
        resume = None
    started = time.perf_counter()
    trainer.fit(Classifier(args), datamodule=Images(args), ckpt_path=resume)
    if trainer.global_rank == 0:
        print(
            f"trained to epoch {trainer.current_epoch} in {time.perf_counter() - started:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
