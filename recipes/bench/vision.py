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
import tempfile
from pathlib import Path

from recipes.bench.harness.bench_charts import slug
from recipes.bench.harness.measure import show_table
from recipes.bench.harness.workers import chosen_workers
from recipes.bench.images.data import ensure_data, parse_image_size
from recipes.bench.images.eval_rows import compare
from recipes.bench.images.train_rows import compare_train


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


def run(args: argparse.Namespace) -> int:
    workers = chosen_workers(args.workers)
    for name, root in data_sets(args):
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


def data_sets(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """`(name, root)` of each folder to measure: `--data`, or the built-in sets of `--set`."""
    if args.data:
        return [("your data", args.data)]
    kinds = (args.set,)
    if args.set == "both":
        kinds = ("generated", "photos")
    size = parse_image_size(args.image_size)
    return [(kind, ensure_data(args.images, size, kind)) for kind in kinds]
