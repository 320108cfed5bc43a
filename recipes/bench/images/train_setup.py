"""What the vision domain hands `recipes bench train`: resnet50 (channels_last, bf16 autocast,
SGD) on CUDA or a tiny CNN on CPU, fed by the torchvision way, ImageFolderFast cold, and
ImageFolderFast warm through make_loader, its thread and isolated paths and DeviceCropLoader.

Use when: reading how `recipes bench train --domain vision` builds its rows (`train_setup`).
Cost: the built-in image folder (built once), one decoded cache in a temp folder (timed, one-off),
and with `--autotune` a tuning run per cold and warm dataset.
Adapt here: `DEFAULTS` (size, batch, images and model per device), the rows of `_loaders`.
Trade-off: every loader reads with `train=True` (random-resized crops and flips), so the rows
differ by the path, not by the work per image.
"""

from __future__ import annotations

import tempfile
import time
from typing import NamedTuple

import torch
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader

from recipes.bench.harness.train_setup import TrainSetup
from recipes.bench.harness.workers import chosen_workers, worker_init_for, workers_override
from recipes.bench.images.data import ensure_data
from recipes.common import autotune, make_loader
from recipes.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DeviceCropLoader,
    DeviceNormalize,
    GpuDecode,
    ImageFolderFast,
    build_image_cache,
    encoded_collate,
    uint8_collate,
)
from recipes.vision.decoding.region_decode import region_decode_available


class TrainDefaults(NamedTuple):
    """What `recipes bench train --domain vision` uses where its arguments are left out."""

    size: int
    batch: int
    images: int
    model: str
    dtype: torch.dtype


# by whether the device is CUDA: a real model on the GPU, a tiny one that a CPU run can afford
DEFAULTS = {
    True: TrainDefaults(224, 256, 6400, "resnet50", torch.bfloat16),
    False: TrainDefaults(96, 32, 320, "tiny", torch.float32),
}


def train_setup(args, device):
    """resnet50 (channels_last, bf16 autocast, SGD) on CUDA, a tiny CNN on CPU, fed by the
    torchvision way, ImageFolderFast cold, ImageFolderFast warm through make_loader and warm
    through DeviceCropLoader, all with `train=True`."""
    cuda = device.type == "cuda"
    defaults = DEFAULTS[cuda]
    size = args.size or defaults.size
    batch = args.batch_size or defaults.batch
    root = ensure_data(args.images or defaults.images)
    model_name = args.model or defaults.model
    step = _vision_step(model_name, device)
    normalize = DeviceNormalize(
        IMAGENET_MEAN, IMAGENET_STD, device=device, dtype=defaults.dtype, channels_last=True
    )

    def to_device(b):
        return normalize(b[0], b[1])

    overrides = workers_override(args.workers)
    common = dict(
        batch_size=batch, shuffle=True, drop_last=True, collate_fn=uint8_collate, **overrides
    )
    cold = ImageFolderFast(root, size=size, train=True)
    warm = ImageFolderFast(root, size=size, train=True)
    cache_dir = tempfile.mkdtemp(prefix="recipes-train-bench-")
    start = time.perf_counter()
    build_image_cache(warm, cache_dir, progress=False)
    build = time.perf_counter() - start
    loaders = [
        _plain_row(root, size, batch, chosen_workers(args.workers), device),
        *_loaders(cold, warm, common, to_device, device, defaults.dtype),
    ]
    if cuda:
        loaders.append(_gpu_decode_row(root, size, common, device, defaults.dtype))
    if args.autotune:
        loaders += _autotuned_rows(cold, warm, batch, step, to_device, cuda, args)
    with torch.no_grad():
        images, targets = next(
            iter(make_loader(warm, batch_size=batch, collate_fn=uint8_collate, num_workers=0))
        )
    resident = normalize(images, targets)
    notes = [
        f"{len(cold)} JPEGs under {root}, {size}px train crops, batch {batch}; decoded cache built "
        f"in {build:.1f} s ({len(cold) / build:,.0f} images/s, one-off)"
    ]
    return TrainSetup("images", step, lambda b: len(b[0]), resident, loaders, model_name, notes)


def _plain_row(root, size: int, batch: int, workers: int, device):
    """The torchvision way: ImageFolder + PIL transforms in DataLoader workers."""
    cuda = device.type == "cuda"
    plain = torchvision.datasets.ImageFolder(
        root,
        transform=T.Compose(
            [
                T.RandomResizedCrop(size),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        ),
    )
    plain_loader = DataLoader(
        plain,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
        worker_init_fn=worker_init_for(workers),
    )

    def plain_to_device(b):
        return (
            b[0].to(device, non_blocking=True).contiguous(memory_format=torch.channels_last),
            b[1].to(device, non_blocking=True),
        )

    return "torchvision ImageFolder + PIL (plain)", plain_loader, plain_to_device


def _loaders(cold, warm, common: dict, to_device, device, dtype) -> list:
    """ImageFolderFast cold and warm through make_loader (its default, then each path) and warm
    through DeviceCropLoader."""
    decoder = "whole-image decode"
    if region_decode_available():
        decoder = "region decode"
    paths = (("threads", "in this process"), ("isolated", "threads of a child process"))
    return [
        (f"ImageFolderFast cold ({decoder}), make_loader", make_loader(cold, **common), to_device),
        (
            "ImageFolderFast warm (cache), make_loader (threads unless --workers)",
            make_loader(warm, **common),
            to_device,
        ),
        *(
            (
                f"ImageFolderFast warm (cache), make_loader path='{p}' ({where})",
                make_loader(warm, **common, path=p),
                to_device,
            )
            for p, where in paths
        ),
        (
            "ImageFolderFast warm (cache), DeviceCropLoader (4 threads, crops on the device)",
            DeviceCropLoader(
                warm, batch_size=common["batch_size"], drop_last=True, device=device, dtype=dtype
            ),
            lambda b: b,
        ),
    ]


def _gpu_decode_row(root, size: int, common: dict, device, dtype):
    """Encoded bytes from the workers, decoded on the GPU by nvJPEG (CUDA only)."""
    encoded = ImageFolderFast(root, size=size, train=True, decode="gpu")
    return (
        "ImageFolderFast decode='gpu' (bytes from workers), GpuDecode (nvJPEG)",
        make_loader(encoded, **{**common, "collate_fn": encoded_collate}),
        GpuDecode(encoded, device=device, dtype=dtype),
    )


def _autotuned_rows(cold, warm, batch: int, step, to_device, cuda: bool, args) -> list:
    """The cold and warm datasets through the settings `autotune` picks for this step."""

    def tuned_step(b):
        step(to_device(b))
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for name, ds in (("cold", cold), ("warm", warm)):
        tuned = autotune(
            ds,
            batch_size=batch,
            collate_fn=uint8_collate,
            step=tuned_step,
            max_seconds=args.autotune_seconds,
            seconds_per_trial=3.0,
            store=False,
        )
        rows.append(
            (
                f"ImageFolderFast {name}, autotuned",
                make_loader(ds, **tuned, shuffle=True, drop_last=True, collate_fn=uint8_collate),
                to_device,
            )
        )
    return rows


def _vision_step(name: str, device):
    if name == "tiny":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, 10),
        )
    elif name in ("resnet50", "resnet18"):
        model = getattr(torchvision.models, name)(weights=None, num_classes=1000)
    else:
        raise ValueError(
            f"`--model` for vision must be resnet50, resnet18 or tiny, but is {name!r} instead."
        )
    model = model.to(device, memory_format=torch.channels_last).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = device.type == "cuda"

    def step(batch):
        images, targets = batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
