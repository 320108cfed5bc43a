"""A Lightning run for the resume tests (`test_lightning_resume.py`): a tiny model trained on
64 numbered samples, each rank logging the samples of every step (`samples-rank<r>.txt`, a line
`epoch id id ...` per step), with `--stop-at EPOCH STEP` a checkpoint there and a kill (no
clean-up), and `--resume` a fresh process resuming from that checkpoint with `ckpt_path`.

Loaders (`--kind`): `workers` (LoaderDataModule, shuffle, 2 worker processes), `threads` (the
thread path, `ThreadLoader`), `bucket` (LengthBucketSampler, `use_distributed_sampler=False`
unless `--lightning-samplers`; `bucket-threads` on the thread path), `robust` (a `RobustLoader`
around a `DistributedSampler`, which Lightning does not re-create), `plain` (no DataModule: the
module's `train_dataloader` returns `make_loader`, as a Lightning user writes it). `--onecycle`:
`configure_optimizers` reads `trainer.estimated_stepping_batches` (OneCycleLR), Lightning #20550's
trigger."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, DistributedSampler

from recipes.common import RobustLoader, make_loader
from recipes.common.frameworks.lightning_glue import LoaderDataModule
from recipes.common.sampling.bucketing import LengthBucketSampler

SAMPLES, BATCH, EPOCHS = 64, 4, 3


class Numbers(Dataset):
    """Sample i is (the tensor [i], i)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return torch.tensor([float(index)]), index


class ThreadNumbers(Numbers):
    """The same samples, read by threads (`ThreadBatched`: `make_loader` takes the thread path)."""

    def thread_batches(self) -> bool:
        return True


class BucketData(LoaderDataModule):
    def train_loader(self):
        lengths = [
            1 + (7 * i) % 13 for i in range(SAMPLES)
        ]  # the ranks are read from torch.distributed
        sampler = LengthBucketSampler(lengths, batch_size=BATCH, seed=0)
        if isinstance(self.dataset, ThreadNumbers):
            return make_loader(self.dataset, batch_sampler=sampler, path="threads", threads=2)
        return make_loader(self.dataset, batch_sampler=sampler, num_workers=2)


class RobustData(LoaderDataModule):
    def train_loader(self):
        sampler = DistributedSampler(
            self.dataset,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            shuffle=True,
            seed=0,
        )
        return RobustLoader(self.dataset, batch_size=BATCH, sampler=sampler, num_workers=2)


class Model(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args, self.layer = args, torch.nn.Linear(1, 1)

    def train_dataloader(self):  # used only without a DataModule (`--kind plain`)
        return make_loader(Numbers(), batch_size=BATCH, shuffle=True, num_workers=2)

    def training_step(self, batch, index):
        x, ids = batch
        with open(self.args.workdir / f"samples-rank{self.global_rank}.txt", "a") as log:
            log.write(f"{self.current_epoch} {' '.join(map(str, ids.tolist()))}\n")
        return self.layer(x / SAMPLES).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, index):
        if self.args.stop_at is not None and [self.current_epoch, index + 1] == self.args.stop_at:
            self.trainer.save_checkpoint(
                self.args.workdir / "checkpoint.ckpt"
            )  # every rank calls it
            self.trainer.strategy.barrier("saved")
            os._exit(0)  # a kill: no clean-up

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        if not self.args.onecycle:
            return optimizer
        steps = self.trainer.estimated_stepping_batches  # sets the training loader up now (#20550)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument(
        "--kind",
        default="workers",
        choices=["workers", "threads", "bucket", "bucket-threads", "robust", "plain"],
    )
    parser.add_argument("--onecycle", action="store_true")
    parser.add_argument("--stop-at", type=int, nargs=2, default=None, metavar=("EPOCH", "STEP"))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--lightning-samplers", action="store_true", help="keep use_distributed_sampler=True"
    )
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", 1))
    data = {
        "workers": lambda: LoaderDataModule(
            Numbers(), batch_size=BATCH, shuffle=True, num_workers=2
        ),
        "threads": lambda: LoaderDataModule(
            ThreadNumbers(), batch_size=BATCH, shuffle=True, path="threads", threads=2
        ),
        "bucket": lambda: BucketData(Numbers()),
        "bucket-threads": lambda: BucketData(ThreadNumbers()),
        "robust": lambda: RobustData(Numbers()),
        "plain": lambda: None,
    }[args.kind]()
    ours = (
        args.kind.startswith("bucket") and not args.lightning_samplers
    )  # LengthBucketSampler splits the ranks
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=EPOCHS,
        use_distributed_sampler=not ours,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(
        Model(args),
        datamodule=data,
        ckpt_path=args.workdir / "checkpoint.ckpt" if args.resume else None,
    )


if __name__ == "__main__":
    main()
