"""`recipes cache DOMAIN ...`: build a domain's cache from the command line, with a progress bar."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    domains = parser.add_subparsers(dest="domain", metavar="DOMAIN", required=True)
    vision = domains.add_parser("vision", help="decode an ImageFolder once into a memory-mapped cache")
    vision.add_argument("root", type=Path, help="ImageFolder root (root/<class>/<image>)")
    vision.add_argument("cache_dir", type=Path, help="folder for the cache file")
    vision.add_argument("--size", type=int, default=224, help="training/eval crop size; the cache holds size/0.875")
    vision.add_argument("--workers", type=int, default=None, help="decode workers (default: smart_num_workers)")
    vision.add_argument("--skip-bad", action="store_true", help="replace undecodable images instead of failing")
    vision.set_defaults(handler=run_vision)


def run_vision(args: argparse.Namespace) -> int:
    from recipes.vision import ImageFolderFast, build_image_cache

    dataset = ImageFolderFast(args.root, size=args.size, on_error="skip" if args.skip_bad else "raise")
    cache = build_image_cache(dataset, args.cache_dir, num_workers=args.workers, progress=True)
    skipped = f", {cache.skipped_count} bad images replaced" if cache.skipped_count else ""
    print(f"{cache.path}: {cache.count} images at {cache.side}x{cache.side}{skipped}")
    return 0
