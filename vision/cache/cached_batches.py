"""Whole batches from a decoded image cache, filled in place, and the eval view a dataset serves.

Use when: a dataset has a decoded cache attached (`ImageFolderFast` with `cache_dir=`, or after
`build_image_cache`). `fill_cached_batch` fills one uint8 `[B, 3, H, W]` batch (channels-last
in memory) row by row: an eval image from its eval view with one `preadv` straight into its row
(no resize, no copy); otherwise the crop's rows `preadv`ed into a scratch buffer, resized
(antialiased bilinear) and flipped into its row. `ImageFolderFast.__getitems__` (DataLoader
workers) calls it with a batch in shared memory and the process's own generator; `read_batch`
(`ThreadLoader`, threads of the training process) with a private batch and the loader's
per-batch generator: it is safe to call from several threads at once. `eval_view_of`
opens the eval view of a resolution, or says why there is none.
Cost: per image one `preadv` (eval view) or one `preadv` plus one resize; the GIL is released
in both.
Adapt here: nothing; the crops are the dataset's (`CropSettings`: `SCALE`/`RATIO`/`CROP_PCT`).
Trade-off: the scratch buffer is per call (`max_side^2 * 3` bytes), not per thread.
Copy with: common/caches/cache_checks.py, common/caches/cache_files.py,
  common/workers/held_descriptors.py, vision/cache/eval_view.py, vision/cache/image_cache.py,
  vision/decoding/crop.py, vision/decoding/decode.py, vision/decoding/image_header.py,
  vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from recipes.vision.cache.eval_view import EvalView, find_eval_view, view_name
from recipes.vision.cache.image_cache import ImageCache, ImageCacheError
from recipes.vision.decoding.crop import CropSettings, eval_box, random_resized_box


def eval_view_of(cache: ImageCache, size: tuple[int, int], crop_pct: float) -> EvalView | None:
    """The eval view of `size` in `cache`'s folder, checking its images as the cache does
    (`cache.checks.verify`); None without one. A missing or damaged view warns, naming it and
    how to rebuild it: eval items then come from the whole images, about 5x slower, with other
    pixels. A dataset opens it once per resolution and process (`ImageFolderFast.eval_view`)."""
    view, why = find_eval_view(
        cache.path,
        cache.fingerprint,
        cache.count,
        size,
        crop_pct,
        ImageCacheError,
        cache.checks.verify,
    )
    if view is None:
        warnings.warn(
            f"No usable eval view {view_name(size, crop_pct)} in {cache.path}: {why}. Eval items "
            "are resized from the whole cached images instead: about 5x slower, and pixels ~1.6 "
            "grey levels from torchvision's (the view's). Rebuild it with "
            f"build_image_cache(dataset) on this eval dataset (train=False, size={size}), or "
            f"`recipes cache vision ROOT CACHE_DIR --size {size[0]}` for a square size.",
            stacklevel=4,
        )  # the dataset's caller
    return view


def read_cached_item(
    cache: ImageCache,
    view: EvalView | None,
    crops: CropSettings,
    index: int,
    rng: np.random.Generator,
) -> torch.Tensor:
    """Cached image `index` cut as `crops` says, not flipped: uint8 `[3, H, W]`, a row of `view`
    when given, else only the crop's rows read and resized (a train crop drawn from `rng`)."""
    out = crops.size
    if view is not None:
        return torch.from_numpy(view.read_into(np.empty((*out, 3), np.uint8), index)).permute(
            2, 0, 1
        )
    h, w = (int(v) for v in cache.shapes[index])
    if crops.train:  # relative to the whole image: torchvision's distribution on the original
        box = random_resized_box(h, w, rng, crops.scale, crops.ratio)
    else:
        box = eval_box(h, w, out, crops.crop_pct)
    return cache.read_crop(index, box, out)


def fill_cached_batch(
    cache: ImageCache,
    view: EvalView | None,
    crops: CropSettings,
    indices: list[int],
    rng: np.random.Generator,
    batch: torch.Tensor,
) -> torch.Tensor:
    """Fills `batch` (uint8 `[B, 3, H, W]`, channels-last, H x W = `crops.size`) with the cached
    items of `indices`: rows of `view` when given, else crops of the whole images, drawing each
    train item's crop, then its flip, from `rng`; returns `batch`."""
    size = crops.size
    rows = batch.permute(0, 2, 3, 1)  # [B, H, W, 3], contiguous
    scratch = None
    for row, index in enumerate(indices):
        if view is not None:
            view.read_into(rows[row].numpy(), index)
            continue
        h, w = (int(v) for v in cache.shapes[index])
        if crops.train:
            box = random_resized_box(h, w, rng, crops.scale, crops.ratio)
        else:
            box = eval_box(h, w, size, crops.crop_pct)
        if scratch is None:
            scratch = np.empty(cache.max_side * cache.max_side * 3, np.uint8)
        mirror = (
            crops.train and rng.random() < 0.5
        )  # drawn after its box, as the worker path draws them
        cache.read_crop(
            index, box, size, scratch=scratch, out=batch[row], mirror=mirror
        )  # into the row
    return batch
