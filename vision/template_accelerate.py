"""Image classification training with the recipes under Hugging Face Accelerate: a script to copy
and adapt.

    recipes template vision --framework accelerate > train.py
    accelerate launch train.py --data /data/train --cache /nvme/recipes-cache      # your GPUs
    torchrun --nproc_per_node=8 train.py --data /data/train --cache /nvme/recipes-cache
    python train.py --smoke            # generated images, a tiny model: under a minute on 2 CPUs
    torchrun --nproc_per_node=2 train.py --smoke     # 2 processes on CPU (gloo): `accelerate launch
                                                     # --cpu` starts one process only

The plain template (`recipes template vision`) with an `Accelerator` doing the distributed
parts: the process group, DDP, mixed precision, `accelerator.backward`, and checkpoints with
`accelerator.save_state()` / `load_state()`. The loader goes through `prepare_loader`
(common/frameworks/accelerate_glue.py), never `accelerator.prepare`, which would rebuild it
as a plain DataLoader and lose its state: checkpoints hold the loader's place, one JSON file
per rank, and a resumed run starts at the first batch it had not trained on, at once.

What to change for your data (lines marked ADAPT):
  - `build_model`: your network (torchvision's resnet50 here; a tiny CNN with --smoke).
  - `--data` (an ImageFolder tree, root/<class>/<image>) and `--cache` (fast local disk:
    the decoded cache stores whole images, about 450 KB per 500x375 JPEG at 224 px).
  - `SIZE`, the progressive schedule, the optimiser and its learning rate.
What each setting buys (measured; README "Benchmarks"): as in the plain template:
  - `build_image_cache` + `make_loader`: decoded once; warm epochs read by threads of this
    process (a `ThreadLoader`), 13-17x torchvision's ImageFolder + PIL on 2 cores.
  - `ElasticDistributedSampler` split before `prepare_loader`: each rank its share, a new order
    each `set_epoch`, a checkpoint that resumes on any number of ranks; accelerate's own
    re-sharding is not used.
  - `uint8_collate` + `DeviceNormalize` (so `device_placement=False`: the uint8 batch is moved
    and normalised in one step on the device), `ProgressiveResolution`, `LoaderMonitor`.
  - Checkpoints: `accelerator.save_state` into `checkpoints/step-N`, marked complete once every
    rank wrote its files; a restart resumes the newest complete one.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from recipes.common import ElasticDistributedSampler, LoaderMonitor, make_loader
from recipes.common.frameworks.accelerate_glue import prepare_loader
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
    parser.add_argument("--lr", type=float, default=0.1)
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


def prepare_data(args, accelerator) -> ImageFolderFast:
    """The dataset, with its decoded cache built once (split across the ranks) and opened by all."""
    size = 64 if args.smoke else SIZE
    if args.smoke:
        args.data = args.workdir / "data"
        args.cache = args.workdir / "cache"
        if accelerator.is_main_process and not (args.data / ".complete").exists():
            make_image_folder(args.data, classes=48, per_class=1, size=(160, 120), seed=0)
            (args.data / ".complete").touch()
    accelerator.wait_for_everyone()
    dataset = ImageFolderFast(
        args.data, size=size, train=True, cache_dir=args.cache, on_error="skip"
    )
    build_image_cache(dataset, args.cache, distributed=accelerator.num_processes > 1)
    return dataset


class Progress:
    """The step count, saved and loaded with the checkpoint (`register_for_checkpointing`)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def save_checkpoint(accelerator, workdir: Path, step: int, keep: int = 2) -> None:
    """`save_state` on every rank into checkpoints/step-N, marked complete once all ranks wrote."""
    folder = workdir / "checkpoints" / f"step-{step:09d}"
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (folder / "complete").touch()
        for old in sorted(p.parent for p in folder.parent.glob("step-*/complete"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(workdir: Path) -> Path | None:
    done = sorted(p.parent for p in (workdir / "checkpoints").glob("step-*/complete"))
    if not done:
        return None
    return done[-1]


def main(argv=None) -> None:
    from accelerate import Accelerator

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision="bf16" if cuda else "no"
    )  # cpu: gloo across processes
    rank = accelerator.process_index
    world = accelerator.num_processes
    device = accelerator.device
    args.workdir.mkdir(parents=True, exist_ok=True)
    dataset = prepare_data(args, accelerator)
    sampler = ElasticDistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = prepare_loader(
        accelerator,
        LoaderMonitor(
            make_loader(
                dataset,
                batch_size=args.batch_size,
                sampler=sampler,
                drop_last=True,
                collate_fn=uint8_collate,
            )
        ),
        device_placement=False,
    )  # DeviceNormalize moves the uint8 batch itself
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    normalize = DeviceNormalize(
        IMAGENET_MEAN, IMAGENET_STD, device=device, dtype=dtype, channels_last=True
    )
    schedule = ProgressiveResolution(
        start=48 if args.smoke else 160,
        end=dataset.size[0],
        start_epoch=0,
        end_epoch=max(0, args.epochs - 2),
    )
    model = build_model(len(dataset.classes), args.smoke).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    checkpoint = latest_checkpoint(args.workdir)
    if checkpoint is not None:  # resume: model, optimiser, random states, and the loader's place
        accelerator.load_state(str(checkpoint))
    log = None
    if args.log_samples:
        log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    for epoch in range(
        loader.epoch, args.epochs
    ):  # the loader's state says which epoch to continue
        loader.set_epoch(epoch)
        schedule.apply(dataset, epoch)  # reaches persistent workers (shared memory)
        start = time.perf_counter()
        loss = None
        for images, targets in loader:
            images, targets = normalize(images, targets)
            with accelerator.autocast():
                loss = torch.nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            progress.step += 1
            if log is not None:
                log.write(" ".join(map(str, targets.tolist())) + "\n")
                log.flush()
            if progress.step % args.checkpoint_every == 0:
                save_checkpoint(accelerator, args.workdir, progress.step)
            if args.stop_after is not None and progress.step >= args.stop_after:
                accelerator.wait_for_everyone()
                os._exit(0)  # a simulated crash: no clean-up, as a killed job
        if progress.step % args.checkpoint_every:  # the epoch's end (the next epoch starts afresh)
            save_checkpoint(accelerator, args.workdir, progress.step)
        if accelerator.is_main_process:
            summary = loader.summary()
            loss_text = "-"  # a resume at the epoch's end: no batch left
            if loss is not None:
                loss_text = f"{loss.item():.3f}"
            print(
                f"epoch {epoch}: {time.perf_counter() - start:.1f} s, loss {loss_text}, "
                f"resolution {dataset.resolution[0]}, data wait {summary['wait_fraction']:.0%}, "
                f"{summary['samples_per_s'] * world:,.0f} images/s",
                flush=True,
            )
    if accelerator.is_main_process:
        print(loader.report())
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
