"""`recipes bench vision`: torchvision ImageFolder + PIL against ImageFolderFast, cold and warm
(eval), then train-mode random-resized crops per worker: the torchvision way, a full decode,
a region decode (only the crop, when nvImageCodec is installed) and, with CUDA, GPU decoding.

Use when: checking what the recipe buys on your machine and your images (`--data ROOT`).
Cost: generates `--images` ImageNet-like JPEGs once (about 500x375, quality 90) into a reusable
folder, then one epoch per loader (best of `--repeat`), all with the same DataLoader settings.
Adapt here: `--workers`, `--batch-size`, `--size`.
Trade-off: "warm" excludes the one-off cache build, whose time is printed separately.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from pathlib import Path

BENCH_VERSION = 3  # bump when the generated data changes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", type=Path, default=None, help="an ImageFolder root (instead of --set)"
    )
    parser.add_argument(
        "--set",
        choices=("generated", "photos", "both"),
        default="both",
        help="built-in data: "
        "smooth JPEGs of one size, photo-like ones (recipes.testing_photos), or both",
    )
    parser.add_argument(
        "--images", type=int, default=800, help="images to generate (built-in sets only)"
    )
    parser.add_argument("--image-size", default="500x375", help="WxH of the generated set's images")
    parser.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: smart_num_workers)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=2, help="epochs per loader; the best is kept")


def default_data_root(images: int, image_size: tuple[int, int], kind: str = "generated") -> Path:
    from recipes.testing_photos import PHOTOS_VERSION

    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recipes" / "bench"
    if kind == "photos":  # sizes drawn from ImageNet's: `image_size` does not apply
        return base / f"vision-photos-v{PHOTOS_VERSION}-{images}"
    suffix = "" if image_size == (500, 375) else f"-{image_size[0]}x{image_size[1]}"
    return base / f"vision-v{BENCH_VERSION}-{images}{suffix}"


def ensure_data(
    images: int, image_size: tuple[int, int] = (500, 375), kind: str = "generated"
) -> Path:
    """The built-in ImageFolder of `images` images (10 classes), built once and reused: the
    generated set (`make_image_folder`) or, with kind="photos", the photographic one."""
    from recipes.testing import make_image_folder, make_photo_folder

    root = default_data_root(images, image_size, kind)
    if (root / ".complete").exists():
        return root
    if kind == "photos":
        make_photo_folder(root, images=images, classes=10, seed=1)
    else:
        make_image_folder(root, classes=10, per_class=max(1, images // 10), size=image_size, seed=1)
    (root / ".complete").touch()
    return root


def _parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(
            f"`--image-size` must look like 500x375, but is {text!r} instead."
        ) from None
    if width <= 0 or height <= 0:
        raise ValueError(f"`--image-size` must be positive, but is {text!r} instead.")
    return width, height


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
    import torch
    import torchvision
    import torchvision.transforms as T
    from torch.utils.data import DataLoader

    from recipes.bench.harness.measure import best_interleaved, measure
    from recipes.common import make_loader, worker_init
    from recipes.vision import ImageFolderFast, build_image_cache, uint8_collate

    settings = dict(
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=worker_init if workers else None,
    )
    baseline = torchvision.datasets.ImageFolder(
        root,
        transform=T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.PILToTensor()]),
    )
    from recipes.bench.harness.peers import litdata_available, litdata_eval_loader

    cold = ImageFolderFast(root, size=size)
    notes = []
    with tempfile.TemporaryDirectory(prefix="recipes-bench-cache-") as cache_dir:
        start = time.perf_counter()
        warm = ImageFolderFast(root, size=size)
        build_image_cache(
            warm, cache_dir, num_workers=workers, progress=False
        )  # with the eval view
        build_seconds = time.perf_counter() - start
        threads = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        loaders = [
            ("torchvision ImageFolder + PIL (baseline)", DataLoader(baseline, **settings)),
            (
                f"decode only: libjpeg-turbo at the DCT scale used, {threads} threads (limit)",
                _DecodeOnly(cold, batch_size, threads),
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
        if peers and litdata_available():
            samples = list(zip(cold.paths, cold.targets.tolist(), strict=True))
            loaders.append(
                (
                    f"LitData StreamingDataset, raw uint8 256 px centre squares, {max(workers, 1)} "
                    "workers (optimize not timed)",
                    litdata_eval_loader(
                        samples,
                        Path(cache_dir) / "litdata",
                        size=size,
                        batch_size=batch_size,
                        workers=max(workers, 1),
                    ),
                )
            )
        elif peers:
            notes.append("LitData row left out: `pip install litdata` to measure it side by side.")
        rows = best_interleaved(
            *(functools.partial(measure, name, loader) for name, loader in loaders), repeat=repeat
        )
        notes.append(
            cost_breakdown(
                warm, ImageFolderFast(root, size=size, train=True, cache_dir=cache_dir), batch_size
            )
        )
    return rows, build_seconds, notes


class _DecodeOnly:
    """Each file read and decoded by libjpeg-turbo (OpenCV) at the DCT scale the eval crop uses,
    in `threads` threads, nothing else: the limit a decoding loader approaches. All files are
    queued at once (no barrier at batch ends, which would let a pipelined loader pass the
    "limit"); yields one range per batch as its decodes finish."""

    def __init__(self, dataset, batch_size: int, threads: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self.threads = threads

    def _decode(self, index: int) -> int:
        from recipes.vision.decoding.crop import eval_box
        from recipes.vision.decoding.decode import dct_reduction, decode_image
        from recipes.vision.decoding.image_header import read_image_file

        data, header = read_image_file(self.dataset.paths[index])
        box = eval_box(header.height, header.width, self.dataset.resolution, self.dataset.CROP_PCT)
        return decode_image(
            data,
            reduce=dct_reduction((box[2], box[3]), self.dataset.resolution),
            header=header,
            strict=False,
        ).shape[0]

    def __iter__(self):
        from concurrent.futures import ThreadPoolExecutor

        n = len(self.dataset)
        with ThreadPoolExecutor(
            self.threads
        ) as pool:  # no barrier between batches: every thread stays busy
            done = 0
            for done, _ in enumerate(pool.map(self._decode, range(n)), 1):
                if done % self.batch_size == 0:
                    yield (range(done - self.batch_size, done),)
            if done % self.batch_size:
                yield (range(done - done % self.batch_size, done),)


class _EmptyBatches:
    """`n // batch_size` uint8 batches, written once each (a worker's batch is in shared
    memory): the hand-over alone, no reading. Map-style, one batch per index."""

    def __init__(self, n: int, batch_size: int, h: int, w: int):
        self.count = max(1, n // batch_size)
        self.shape = (batch_size, 3, h, w)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        from recipes.vision.batches.batch_buffers import new_uint8_batch

        if index >= self.count:
            raise IndexError(index)
        batch = new_uint8_batch(*self.shape)
        batch.fill_(1)
        return batch

    def thread_batches(self) -> bool:
        return True

    def read_batch(self, indices, rng):
        return self[indices[0]]  # ThreadLoader(batch_size=1): one prepared batch per index


def cost_breakdown(eval_ds, train_ds, batch_size: int, images: int = 400) -> str:
    """Per-image costs of the warm path in microseconds, one thread (torch too): read (the eval
    view's `preadv`; a train crop's rows), the crop's resize into its batch row, the mirror of
    half the crops (resized apart, then mirrored into the row), and the
    hand-over of a finished batch (a DataLoader worker's shared-memory batch against a thread's
    future). A Markdown table."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from recipes.common import ThreadLoader
    from recipes.vision.batches.batch_buffers import new_uint8_batch
    from recipes.vision.decoding.crop import random_resized_box
    from recipes.vision.decoding.decode import _opencv, resize_uint8

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = min(images, len(eval_ds))
        h, w = eval_ds.resolution
        view = eval_ds.eval_view
        cache = train_ds.cache
        out = np.empty((h, w, 3), np.uint8)
        batch = new_uint8_batch(1, 3, h, w)
        scratch = np.empty(cache.max_side * cache.max_side * 3, np.uint8)
        rng = np.random.default_rng(0)
        spent = dict.fromkeys(("view", "rows", "resize", "copy"), 0.0)
        for i in range(n):
            t0 = time.perf_counter()
            if view is not None:
                view.read_into(out, i)
            t1 = time.perf_counter()
            ih, iw = (int(v) for v in cache.shapes[i])
            top, left, bh, bw = random_resized_box(ih, iw, rng, train_ds.SCALE, train_ds.RATIO)
            t2 = time.perf_counter()
            rows = cache.read_rows(i, top, bh, scratch[: bh * iw * 3].reshape(bh, iw, 3))
            t3 = time.perf_counter()
            crop = rows[:, left : left + bw]
            crop = np.ascontiguousarray(crop) if bw != iw else crop  # as ImageCache.read_crop
            flip = i % 2 == 1  # half the crops are mirrored
            image = resize_uint8(
                crop, (h, w), out=None if flip else batch[0]
            )  # into the row, as the thread path
            t4 = time.perf_counter()
            if flip:
                _opencv().flip(
                    image.permute(1, 2, 0).numpy(), 1, dst=batch[0].permute(1, 2, 0).numpy()
                )
            t5 = time.perf_counter()
            for key, seconds in zip(spent, (t1 - t0, t3 - t2, t4 - t3, t5 - t4), strict=True):
                spent[key] += seconds
        handover = {}
        for name, loader in (
            (
                "DataLoader worker (1, shared-memory batch)",
                DataLoader(_EmptyBatches(n, batch_size, h, w), batch_size=None, num_workers=1),
            ),
            (
                "thread (ThreadLoader future)",
                ThreadLoader(_EmptyBatches(n, batch_size, h, w), batch_size=1, threads=1),
            ),
        ):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                count = sum(len(b) for b in loader)
                best = min(best, (time.perf_counter() - start) / count)
            handover[name] = best
    finally:
        torch.set_num_threads(torch_threads)
    us = {key: 1e6 * value / n for key, value in spent.items()}
    lines = [
        "| per image, one thread | us |",
        "|---|---:|",
        f"| eval: read the eval view row (`preadv`) | {us['view']:,.0f} |",
        f"| train: read the crop's rows (`preadv`) | {us['rows']:,.0f} |",
        f"| train: resize the crop into the batch row (antialiased bilinear) | {us['resize']:,.0f} "
        "|",
        f"| train: mirror into the row (half the crops; averaged over all) | {us['copy']:,.0f} |",
    ]
    lines += [
        f"| hand-over of a batch of {batch_size}, per image: {name} | {1e6 * value:,.0f} |"
        for name, value in handover.items()
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from recipes.bench.harness.bench_charts import slug
    from recipes.bench.harness.measure import show_table
    from recipes.bench.vision_train import compare_train
    from recipes.common import smart_num_workers

    kinds = ("generated", "photos") if args.set == "both" else (args.set,)
    sets = (
        [("your data", args.data)]
        if args.data
        else [
            (kind, ensure_data(args.images, _parse_size(args.image_size), kind)) for kind in kinds
        ]
    )
    workers = smart_num_workers() if args.workers is None else args.workers
    for name, root in sets:
        rows, build_seconds, notes = compare(
            root, size=args.size, batch_size=args.batch_size, workers=workers, repeat=args.repeat
        )
        count = rows[0].items
        show_table(
            f"vision, {name} set: {count} images from {root}, {args.size}px eval, batch "
            f"{args.batch_size}, {workers} workers",
            rows,
            unit="images/s",
            plot=args.plot,
            name=f"vision-eval-{slug(name)}",
        )
        print(
            f"\ncache build: {build_seconds:.1f} s ({count / build_seconds:,.0f} images/s, one-off)"
        )
        for note in notes:
            print(f"\n{note}")
        with tempfile.TemporaryDirectory(prefix="recipes-bench-cache-") as warm_dir:
            train_rows = compare_train(
                root,
                size=args.size,
                batch_size=args.batch_size,
                workers=workers,
                repeat=args.repeat,
                warm_dir=warm_dir,
            )
        show_table(
            f"vision train, {name} set: random-resized crops + flips, {args.size}px, batch "
            f"{args.batch_size}, {workers} workers (img/s per worker = rate / {max(workers, 1)})",
            train_rows,
            unit="images/s",
            plot=args.plot,
            name=f"vision-train-{slug(name)}",
        )
    return 0


# ---- `recipes bench train --domain vision` -------------------------------------------------
def train_setup(args, device):
    """resnet50 (channels_last, bf16 autocast, SGD) on CUDA, a tiny CNN on CPU, fed by the
    torchvision way, ImageFolderFast cold, ImageFolderFast warm through make_loader and warm
    through DeviceCropLoader, all with `train=True`."""
    import tempfile

    import torch
    import torchvision
    import torchvision.transforms as T
    from torch.utils.data import DataLoader

    from recipes.bench.harness.train_setup import TrainSetup
    from recipes.common import make_loader, smart_num_workers, worker_init
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

    cuda = device.type == "cuda"
    size = args.size or (224 if cuda else 96)
    batch = args.batch_size or (256 if cuda else 32)
    root = ensure_data(args.images or (6400 if cuda else 320))
    model_name = args.model or ("resnet50" if cuda else "tiny")
    step = _vision_step(model_name, device)
    workers = smart_num_workers() if args.workers is None else args.workers
    dtype = torch.bfloat16 if cuda else torch.float32
    normalize = DeviceNormalize(
        IMAGENET_MEAN, IMAGENET_STD, device=device, dtype=dtype, channels_last=True
    )
    overrides = {} if args.workers is None else {"num_workers": args.workers}

    def to_device(b):
        return normalize(b[0], b[1])

    def plain_to_device(b):
        return (
            b[0].to(device, non_blocking=True).contiguous(memory_format=torch.channels_last),
            b[1].to(device, non_blocking=True),
        )

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
        worker_init_fn=worker_init if workers else None,
    )
    common = dict(
        batch_size=batch, shuffle=True, drop_last=True, collate_fn=uint8_collate, **overrides
    )
    cold = ImageFolderFast(root, size=size, train=True)
    warm = ImageFolderFast(root, size=size, train=True)
    cache_dir = tempfile.mkdtemp(prefix="recipes-train-bench-")
    start = time.perf_counter()
    build_image_cache(warm, cache_dir, progress=False)
    build = time.perf_counter() - start
    decoder = "region decode" if region_decode_available() else "whole-image decode"
    loaders = [
        ("torchvision ImageFolder + PIL (plain)", plain_loader, plain_to_device),
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
            for p, where in (
                ("threads", "in this process"),
                ("isolated", "threads of a child process"),
            )
        ),
        (
            "ImageFolderFast warm (cache), DeviceCropLoader (4 threads, crops on the device)",
            DeviceCropLoader(warm, batch_size=batch, drop_last=True, device=device, dtype=dtype),
            lambda b: b,
        ),
    ]
    if cuda:
        encoded = ImageFolderFast(root, size=size, train=True, decode="gpu")
        loaders.append(
            (
                "ImageFolderFast decode='gpu' (bytes from workers), GpuDecode (nvJPEG)",
                make_loader(encoded, **{**common, "collate_fn": encoded_collate}),
                GpuDecode(encoded, device=device, dtype=dtype),
            )
        )
    if args.autotune:
        from recipes.common import autotune

        def tuned_step(b):
            step(to_device(b))
            if cuda:
                torch.cuda.synchronize()

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
            loaders.append(
                (
                    f"ImageFolderFast {name}, autotuned",
                    make_loader(
                        ds, **tuned, shuffle=True, drop_last=True, collate_fn=uint8_collate
                    ),
                    to_device,
                )
            )
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


def _vision_step(name: str, device):
    import torch
    import torchvision

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
