"""The train rows of `recipes bench vision`: random-resized crops + flips per worker, the
torchvision way against ImageFolderFast's (a full decode, a region decode when nvImageCodec is
installed, GPU decoding with CUDA, and crops over the warm cache).

Use when: reading how `recipes bench vision`'s second table is measured (`compare_train`).
Cost: one epoch per loader, best of `repeat`, in turns; a warm cache built once in `warm_dir`.
Adapt here: the rows of `compare_train`.
Trade-off: the same DataLoader settings for every row; rates are per loader, not per worker.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader

from recipes.bench.harness.measure import best_interleaved, measure
from recipes.bench.harness.workers import worker_init_for
from recipes.common import make_loader
from recipes.vision import (
    GpuDecode,
    ImageFolderFast,
    build_image_cache,
    encoded_collate,
    uint8_collate,
)
from recipes.vision.decoding.region_decode import region_decode_available


def compare_train(
    root: Path,
    *,
    size: int = 224,
    batch_size: int = 32,
    workers: int = 1,
    repeat: int = 2,
    device: str | None = None,
    warm_dir: str | None = None,
):
    """Train-mode rows on `root`: torchvision RandomResizedCrop + flip (baseline), ImageFolderFast
    decoding whole images, decoding only the crop (region decode, when available), on CUDA
    `decode="gpu"` with `GpuDecode` (synchronised per batch) and, with `warm_dir`, crops from a
    decoded cache built there through DataLoader workers and through make_loader's defaults
    (threads). Returns the rows."""
    if device is None and torch.cuda.is_available():
        device = "cuda"
    elif device is None:
        device = "cpu"
    settings = dict(
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=device == "cuda",
        worker_init_fn=worker_init_for(workers),
    )
    baseline = torchvision.datasets.ImageFolder(
        root,
        transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()]),
    )
    loaders = [
        ("torchvision RandomResizedCrop + PIL (baseline)", DataLoader(baseline, **settings)),
        (
            "ImageFolderFast train, whole-image decode",
            DataLoader(
                ImageFolderFast(root, size=size, train=True, region_decode=False),
                collate_fn=uint8_collate,
                **settings,
            ),
        ),
    ]
    if region_decode_available():
        loaders.append(
            (
                "ImageFolderFast train, region decode (crop only)",
                DataLoader(
                    ImageFolderFast(root, size=size, train=True, region_decode=True),
                    collate_fn=uint8_collate,
                    **settings,
                ),
            )
        )
    if device == "cuda":
        gpu = ImageFolderFast(root, size=size, train=True, decode="gpu")
        to_images = GpuDecode(gpu, device=device, dtype=torch.bfloat16)

        def decoded(loader):
            for batch in loader:
                images, targets = to_images(batch)
                torch.cuda.synchronize()
                yield images, targets

        loaders.append(
            (
                "decode='gpu' + GpuDecode (bytes from workers, nvJPEG)",
                _Reiterable(DataLoader(gpu, collate_fn=encoded_collate, **settings), decoded),
            )
        )
    if warm_dir is not None:  # crops over the cached whole images
        warm = ImageFolderFast(root, size=size, train=True)
        build_image_cache(warm, warm_dir, num_workers=workers, progress=False)
        loaders += [
            (
                "ImageFolderFast train warm (cache), DataLoader workers",
                DataLoader(warm, collate_fn=uint8_collate, shuffle=True, **settings),
            ),
            (
                "ImageFolderFast train warm (cache), make_loader defaults (threads)",
                make_loader(warm, batch_size=batch_size, shuffle=True),
            ),
        ]
    return best_interleaved(
        *(functools.partial(measure, name, loader) for name, loader in loaders), repeat=repeat
    )


class _Reiterable:
    """`wrap(loader)` as an iterable that can be iterated more than once."""

    def __init__(self, loader, wrap):
        self.loader = loader
        self.wrap = wrap

    def __iter__(self):
        return self.wrap(self.loader)
