"""The eval rows of `recipes bench vision`: torchvision ImageFolder + PIL against
ImageFolderFast cold and warm, through DataLoader workers and make_loader's defaults, beside the
decode-only limit and, when installed, LitData's raw uint8 path.

Use when: reading how `recipes bench vision`'s first table is measured (`compare`).
Cost: one decoded cache built into a temp folder (timed apart), then one epoch per loader, best
of `repeat`, in turns.
Adapt here: the rows of `eval_loaders`.
Trade-off: "warm" excludes the one-off cache build, whose time is returned separately.
"""

from __future__ import annotations

import functools
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader

from recipes.bench.harness.measure import best_interleaved, measure
from recipes.bench.harness.peers import litdata_available, litdata_eval_loader
from recipes.bench.harness.workers import usable_cpus, worker_init_for
from recipes.bench.images.warm_costs import cost_breakdown
from recipes.common import make_loader
from recipes.vision import ImageFolderFast, build_image_cache, uint8_collate
from recipes.vision.decoding.crop import eval_box
from recipes.vision.decoding.decode import dct_reduction, decode_image
from recipes.vision.decoding.image_header import read_image_file


def compare(
    root: Path,
    *,
    size: int = 224,
    batch_size: int = 32,
    workers: int = 1,
    repeat: int = 2,
    peers: bool = True,
):
    """Measures the baseline, the decode-only limit, cold and warm loaders (DataLoader workers
    and make_loader's defaults) and, when installed, LitData's raw uint8 path on `root`;
    returns (rows, build seconds, notes)."""
    cold = ImageFolderFast(root, size=size)
    notes = []
    with tempfile.TemporaryDirectory(prefix="recipes-bench-cache-") as cache_dir:
        start = time.perf_counter()
        warm = ImageFolderFast(root, size=size)
        # with the eval view
        build_image_cache(warm, cache_dir, num_workers=workers, progress=False)
        build_seconds = time.perf_counter() - start
        loaders = eval_loaders(root, cold, warm, size=size, batch_size=batch_size, workers=workers)
        if peers and litdata_available():
            loaders.append(_litdata_row(cold, cache_dir, size, batch_size, workers))
        elif peers:
            notes.append("LitData row left out: `pip install litdata` to measure it side by side.")
        rows = best_interleaved(
            *(functools.partial(measure, name, loader) for name, loader in loaders), repeat=repeat
        )
        train = ImageFolderFast(root, size=size, train=True, cache_dir=cache_dir)
        notes.append(cost_breakdown(warm, train, batch_size))
    return rows, build_seconds, notes


def eval_loaders(root: Path, cold, warm, *, size: int, batch_size: int, workers: int) -> list:
    """`(name, loader)` rows: the baseline, the decode-only limit, then ImageFolderFast cold
    and warm through DataLoader workers and through make_loader's defaults."""
    settings = dict(
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=worker_init_for(workers),
    )
    baseline = torchvision.datasets.ImageFolder(
        root,
        transform=T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.PILToTensor()]),
    )
    threads = usable_cpus()
    return [
        ("torchvision ImageFolder + PIL (baseline)", DataLoader(baseline, **settings)),
        (
            f"decode only: libjpeg-turbo at the DCT scale used, {threads} threads (limit)",
            DecodeOnly(cold, batch_size, threads),
        ),
        (
            "ImageFolderFast cold (decode), DataLoader workers",
            DataLoader(ImageFolderFast(root, size=size), collate_fn=uint8_collate, **settings),
        ),
        (
            "ImageFolderFast cold (decode), make_loader defaults (threads)",
            make_loader(cold, batch_size=batch_size),
        ),
        (
            "ImageFolderFast warm (eval view), DataLoader workers",
            DataLoader(warm, collate_fn=uint8_collate, **settings),
        ),
        (
            "ImageFolderFast warm (eval view), make_loader defaults (threads)",
            make_loader(warm, batch_size=batch_size),
        ),
    ]


def _litdata_row(cold, cache_dir: str, size: int, batch_size: int, workers: int):
    """LitData's raw uint8 path over the same images, as a `(name, loader)` row."""
    samples = list(zip(cold.paths, cold.targets.tolist(), strict=True))
    peer_workers = max(workers, 1)
    loader = litdata_eval_loader(
        samples,
        Path(cache_dir) / "litdata",
        size=size,
        batch_size=batch_size,
        workers=peer_workers,
    )
    name = (
        f"LitData StreamingDataset, raw uint8 256 px centre squares, {peer_workers} "
        "workers (optimize not timed)"
    )
    return name, loader


class DecodeOnly:
    """Each file read and decoded by libjpeg-turbo (OpenCV) at the DCT scale the eval crop uses,
    in `threads` threads, nothing else: the limit a decoding loader approaches. All files are
    queued at once (no barrier at batch ends, which would let a pipelined loader pass the
    "limit"); yields one range per batch as its decodes finish."""

    def __init__(self, dataset, batch_size: int, threads: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self.threads = threads

    def _decode(self, index: int) -> int:
        data, header = read_image_file(self.dataset.paths[index])
        box = eval_box(header.height, header.width, self.dataset.resolution, self.dataset.CROP_PCT)
        return decode_image(
            data,
            reduce=dct_reduction((box[2], box[3]), self.dataset.resolution),
            header=header,
            strict=False,
        ).shape[0]

    def __iter__(self):
        n = len(self.dataset)
        # no barrier between batches: every thread stays busy
        with ThreadPoolExecutor(self.threads) as pool:
            done = 0
            for done, _ in enumerate(pool.map(self._decode, range(n)), 1):
                if done % self.batch_size == 0:
                    yield (range(done - self.batch_size, done),)
            if done % self.batch_size:
                yield (range(done - done % self.batch_size, done),)
