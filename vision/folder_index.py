"""What an `ImageFolderFast` is built from: its decode settings checked, its folder indexed.

Use when: constructing the dataset (`ImageFolderFast.__init__` calls these, once per dataset).
Cost: one walk of `root/<class>/` (torchvision's `make_dataset`: a `scandir` per class folder);
the index is held as `PackedStrings` and an int64 array: no per-sample Python objects for forked
workers to copy on read.
Adapt here: the checks of `checked_settings`; the classes come from the dataset's
`find_classes` hook (as in torchvision), the files from `extensions=` or `is_valid_file=`.
Trade-off: the errors are raised at construction, before any file is decoded: a setting this
machine cannot serve (decode="gpu" without CUDA, region decode without nvImageCodec) fails at
once rather than in a worker.
Copy with: common/caches/packed_strings.py, vision/decoding/crop.py, vision/decoding/decode.py,
  vision/decoding/image_header.py, vision/decoding/jpeg_damage.py, vision/decoding/region_decode.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from recipes.common.caches.packed_strings import PackedStrings
from recipes.vision.decoding.crop import output_size
from recipes.vision.decoding.region_decode import region_decode_available


@dataclass(frozen=True)
class FolderSettings:
    """The checked output `size` (height, width), `max_side` of the decoded cache and the folder
    of that cache (None: decoded from files)."""

    size: tuple[int, int]
    max_side: int
    cache_dir: Path | None


def checked_settings(
    size,
    *,
    on_error: str,
    decode: str,
    transform: Callable | None,
    cache_dir: str | os.PathLike | None,
    region_decode: bool | None,
    max_side: int | None,
) -> FolderSettings:
    """`ImageFolderFast`'s size and decode arguments checked against each other and this machine.

    Raises:
        ValueError: an `on_error`, size, decode mode or `max_side` out of range, or decode="gpu"
            with a `transform` or `cache_dir` (both belong to the CPU path).
        RuntimeError: decode="gpu" without CUDA.
        ImportError: region_decode=True without nvImageCodec.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"`on_error` must be 'raise' or 'skip', but is {on_error!r} instead.")
    size = output_size(size)
    if decode not in ("cpu", "gpu"):
        raise ValueError(f"`decode` must be 'cpu' or 'gpu', but is {decode!r} instead.")
    if decode == "gpu" and (transform is not None or cache_dir is not None):
        raise ValueError(
            "decode='gpu' decodes files on the device: a uint8 `transform` or a decoded cache "
            "(`cache_dir`) belongs to the CPU path (decode='cpu')."
        )
    if decode == "gpu" and not torch.cuda.is_available():
        raise RuntimeError(
            "decode='gpu' needs CUDA, which is not available here; use the CPU path "
            "(decode='cpu', the default), which is as fast as this machine's cores allow."
        )
    if region_decode and not region_decode_available():
        raise ImportError(
            'region_decode=True needs nvImageCodec: pip install "loader-recipes[roi]" '
            "(nvidia-nvimgcodec-cu12; its CPU decoder needs no GPU)."
        )
    side = max_side
    if side is None:
        side = 2 * max(size)
    if not isinstance(side, int) or side < max(size):
        raise ValueError(
            f"`max_side` must be an int of at least the output side {max(size)}, but is "
            f"{max_side!r} instead."
        )
    folder = None
    if cache_dir is not None:
        folder = Path(cache_dir)
    return FolderSettings(size=size, max_side=side, cache_dir=folder)


class FolderIndex(NamedTuple):
    """The files of a folder tree, in torchvision's order, and their class indices."""

    paths: PackedStrings
    targets: np.ndarray  # int64 [N]


def index_folder(
    root: str,
    class_to_idx: dict[str, int],
    extensions: tuple[str, ...] | None,
    is_valid_file: Callable[[str], bool] | None,
) -> FolderIndex:
    """torchvision's `make_dataset` over `root` (its errors: no valid files), held as arrays;
    `extensions` defaults to torchvision's `IMG_EXTENSIONS` when neither filter is given."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    if extensions is None and is_valid_file is None:
        extensions = IMG_EXTENSIONS
    samples = make_dataset(root, class_to_idx, extensions, is_valid_file)
    paths = PackedStrings(path for path, _ in samples)
    targets = np.fromiter((t for _, t in samples), np.int64, len(samples))
    return FolderIndex(paths=paths, targets=targets)
