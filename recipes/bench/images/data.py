"""The built-in image folders of the vision benchmarks: generated JPEGs of one size, or
photo-like ones (`recipes.testing_photos`), each built once into a reusable cache folder.

Use when: a benchmark needs an ImageFolder and the user gave none (`--data`).
Cost: the first call writes `images` JPEGs (seconds to a minute); later calls find the folder's
`.complete` marker and return at once.
Adapt here: `BENCH_VERSION` (bump when the generated data changes), the folder names.
Trade-off: the folders stay under `$XDG_CACHE_HOME/recipes/bench` until removed by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

from recipes.testing import make_image_folder, make_photo_folder
from recipes.testing_photos import PHOTOS_VERSION

BENCH_VERSION = 3  # bump when the generated data changes
DEFAULT_IMAGE_SIZE = (500, 375)


def default_data_root(images: int, image_size: tuple[int, int], kind: str = "generated") -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recipes" / "bench"
    if kind == "photos":  # sizes drawn from ImageNet's: `image_size` does not apply
        return base / f"vision-photos-v{PHOTOS_VERSION}-{images}"
    suffix = ""
    if image_size != DEFAULT_IMAGE_SIZE:
        suffix = f"-{image_size[0]}x{image_size[1]}"
    return base / f"vision-v{BENCH_VERSION}-{images}{suffix}"


def ensure_data(
    images: int, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE, kind: str = "generated"
) -> Path:
    """The built-in ImageFolder of `images` images (10 classes), built once and reused: the
    generated set (`make_image_folder`) or, with kind="photos", the photographic one."""
    root = default_data_root(images, image_size, kind)
    if (root / ".complete").exists():
        return root
    if kind == "photos":
        make_photo_folder(root, images=images, classes=10, seed=1)
    else:
        make_image_folder(root, classes=10, per_class=max(1, images // 10), size=image_size, seed=1)
    (root / ".complete").touch()
    return root


def parse_image_size(text: str) -> tuple[int, int]:
    """`--image-size`'s `WxH` as `(width, height)`."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(
            f"`--image-size` must look like 500x375, but is {text!r} instead."
        ) from None
    if width <= 0 or height <= 0:
        raise ValueError(f"`--image-size` must be positive, but is {text!r} instead.")
    return width, height
