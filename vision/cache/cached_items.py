"""CachedItems: a decoded image cache as a dataset serves it, with its eval views.

Use when: a dataset serves its items from an opened `ImageCache` (`ImageFolderFast.use_cache`).
It checks the cache against the dataset's targets once, cuts items and whole batches as the
dataset's `CropSettings` say (`read_cached_item`, `fill_cached_batch`) and opens the eval view
of each resolution once per process (`eval_view_of`, which warns when there is none).
Cost: a dict look-up per item or batch for the view; the reads are `cached_batches.py`'s.
Adapt here: nothing; the crops are the dataset's, the flip and `transform` are applied by it.
Trade-off: views are kept per process and resolution and never closed until the cache is
replaced; a view found missing stays missing in that process (rebuild, then reopen the dataset).
Copy with: common/caches/cache_checks.py, common/caches/cache_files.py,
  common/workers/held_descriptors.py, vision/cache/cached_batches.py, vision/cache/eval_view.py,
  vision/cache/image_cache.py, vision/decoding/crop.py, vision/decoding/decode.py,
  vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import numpy as np
import torch

from recipes.vision.cache.cached_batches import eval_view_of, fill_cached_batch, read_cached_item
from recipes.vision.cache.eval_view import EvalView
from recipes.vision.cache.image_cache import ImageCache
from recipes.vision.decoding.crop import CropSettings


class CachedItems:
    """The items of a dataset read from its decoded cache.

    Args:
        cache: the opened cache.
        targets: `int64 [N]`, the dataset's class indices: the cache's labels must equal them.

    Attributes:
        cache: the opened cache.
        views: the eval views opened in this process, by resolution (None: there is none).

    Raises:
        ValueError: the cache holds another number of images than `targets`.
        ImageCacheError: `labels.bin` disagrees with `targets`.
    """

    def __init__(self, cache: ImageCache, targets: np.ndarray):
        if cache.count != len(targets):
            raise ValueError(
                f"the cache holds {cache.count} images but the dataset has {len(targets)}."
            )
        cache.check_labels(targets)
        self.cache = cache
        self.views: dict[tuple[int, int], EvalView | None] = {}

    def eval_view(self, crops: CropSettings) -> EvalView | None:
        """The eval view of `crops`' resolution; None for train crops or when there is none."""
        if crops.train:
            return None
        if crops.size not in self.views:
            self.views[crops.size] = eval_view_of(self.cache, crops.size, crops.crop_pct)
        return self.views[crops.size]

    def item(self, index: int, crops: CropSettings, rng: np.random.Generator) -> torch.Tensor:
        """uint8 `[3, H, W]`: cached image `index` cut as `crops` says, not flipped
        (`read_cached_item`)."""
        return read_cached_item(self.cache, self.eval_view(crops), crops, index, rng)

    def items(
        self,
        indices: list[int],
        crops: CropSettings,
        rng: np.random.Generator,
        batch: torch.Tensor,
    ) -> list[tuple[torch.Tensor, int]]:
        """`(row of batch, label)` per index, `batch` (uint8 `[B, 3, H, W]`, channels-last)
        filled by `fill_cached_batch`, train items flipped."""
        labels = self.cache.labels[indices]
        fill_cached_batch(self.cache, self.eval_view(crops), crops, indices, rng, batch)
        return [(batch[row], int(t)) for row, t in enumerate(labels)]
