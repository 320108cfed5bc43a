"""Whole batches from a decoded image cache, filled in place: the worker path and the thread path.

Use when: `ImageFolderFast` has a decoded cache attached. Both ways of serving it fill one
uint8 `[B, 3, H, W]` batch (channels-last in memory) row by row: an eval image from its eval
view with one `preadv` straight into its row (no resize, no copy); otherwise the crop's rows
`preadv`ed into a scratch buffer, resized (antialiased bilinear) and flipped into its row.
`__getitems__` (DataLoader workers) fills a batch in shared memory with the process's own
generator; `read_batch` (`ThreadLoader`, threads of the training process) a private batch with
the loader's per-batch generator, and is safe to call from several threads at once.
Cost: per image one `preadv` (eval view) or one `preadv` plus one resize; the GIL is released
in both.
Adapt here: nothing; the crops are `ImageFolderFast.SCALE`/`RATIO`/`CROP_PCT`.
Trade-off: the scratch buffer is per call (`max_side^2 * 3` bytes), not per thread.
Copy with: common/cache_checks.py, common/cache_files.py, common/held_descriptors.py,
  common/process_lifetime.py, vision/batch_buffers.py, vision/crop.py, vision/decode.py, vision/eval_view.py,
  vision/image_cache.py, vision/stale_caches.py.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from recipes.vision.batch_buffers import trim_heap
from recipes.vision.crop import eval_box, random_resized_box
from recipes.vision.eval_view import EvalView, find_eval_view, view_name
from recipes.vision.image_cache import ImageCacheError

if TYPE_CHECKING:
    from recipes.vision.image_folder import ImageFolderFast


def thread_batches(dataset: ImageFolderFast) -> bool:
    """Whether threads can make its batches: no `transform` (Python per item, holding the GIL)
    and decode="cpu". From a cache an item is a `preadv` and a resize; from a file a read, a
    libjpeg-turbo decode and a resize: OpenCV and nvImageCodec release the GIL in both."""
    return dataset.transform is None and dataset.decode == "cpu"


def eval_view_of(dataset: ImageFolderFast) -> EvalView | None:
    """The cache's eval view at the dataset's current resolution (eval mode only), opened once
    per resolution and process, checking its images as the cache does (`cache.checks.verify`);
    None without one. A missing or damaged view warns once, naming it and how to rebuild it:
    eval items then come from the whole images, about 5x slower, with other pixels."""
    cache = dataset.cache
    if cache is None or dataset.train:
        return None
    size = dataset.resolution
    if size not in dataset._views:
        view, why = find_eval_view(cache.path, cache.fingerprint, cache.count, size, dataset.CROP_PCT,
                                   ImageCacheError, cache.checks.verify)
        if view is None:
            warnings.warn(f"No usable eval view {view_name(size, dataset.CROP_PCT)} in {cache.path}: {why}. Eval "
                          "items are resized from the whole cached images instead: about 5x slower, and pixels "
                          "~1.6 grey levels from torchvision's (the view's). Rebuild it with build_image_cache(dataset) "
                          f"on this eval dataset (train=False, size={size}), or `recipes cache vision ROOT "
                          f"CACHE_DIR --size {size[0]}` for a square size.", stacklevel=3)
        dataset._views[size] = view
    return dataset._views[size]


def fill_cached_batch(dataset: ImageFolderFast, indices: list[int], rng: np.random.Generator,
                      batch: torch.Tensor) -> torch.Tensor:
    """Fills `batch` (uint8 `[B, 3, H, W]`, channels-last) with the cached items of `indices`,
    drawing each train item's crop, then its flip, from `rng`; returns `batch`."""
    cache, view, size = dataset.cache, dataset.eval_view, dataset.resolution
    rows = batch.permute(0, 2, 3, 1)  # [B, H, W, 3], contiguous
    scratch = None
    for row, index in enumerate(indices):
        if view is not None:
            view.read_into(rows[row].numpy(), index)
            continue
        h, w = (int(v) for v in cache.shapes[index])
        if dataset.train:
            box = random_resized_box(h, w, rng, dataset.SCALE, dataset.RATIO)
        else:
            box = eval_box(h, w, size, dataset.CROP_PCT)
        if scratch is None:
            scratch = np.empty(cache.max_side * cache.max_side * 3, np.uint8)
        mirror = dataset.train and rng.random() < 0.5  # drawn after its box, as the worker path draws them
        cache.read_crop(index, box, size, scratch=scratch, out=batch[row], mirror=mirror)  # into the row
    return batch


def fill_decoded_batch(dataset: ImageFolderFast, indices: list[int], rng: np.random.Generator,
                       batch: torch.Tensor) -> np.ndarray:
    """Fills `batch` with the items of `indices` decoded from their files (crops and flips from
    `rng`; with on_error="skip" a bad file's replacement, counted); returns their targets."""
    targets = np.empty(len(indices), np.int64)
    for row, index in enumerate(indices):
        _, targets[row], _ = dataset._load_or_skip(  # resized into the row (no transform on this path)
            index, functools.partial(dataset._output_image, rng=rng, into=batch[row]), rng)
    trim_heap()  # decode buffers fragment the heap (batch_buffers.trim_heap)
    return targets


def read_items(dataset: ImageFolderFast, indices: list[int], rng: np.random.Generator) -> list[tuple[torch.Tensor, int]]:
    """`read_batch`'s items, `(image, target)` each (rows of one batch tensor), for a collate
    function of the user's on the thread path: the same draws from `rng`."""
    images, targets = read_batch(dataset, indices, rng)
    return [(images[row], int(t)) for row, t in enumerate(targets.tolist())]


def read_batch(dataset: ImageFolderFast, indices: list[int], rng: np.random.Generator, *,
               pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`read_batch(indices, rng)`: `(images uint8 [B, 3, H, W] channels-last, targets int64 [B])`,
    what `uint8_collate` returns for the same items, crops and flips drawn from `rng`, from the
    cache when one is attached, else decoded from the files; safe to call from several threads
    at once. With `pin_memory` (CUDA), the batch is filled in place in page-locked memory from
    torch's caching host allocator (blocks are reused once their copies to the device are
    done): no second copy into pinned memory."""
    if not dataset.thread_batches():
        raise ValueError("read_batch makes batches in threads, which a `transform` (Python per item) or "
                         "decode='gpu' rule out; use DataLoader workers (make_loader(..., path='workers')).")
    indices = [dataset._check_index(i) for i in indices]
    h, w = dataset.resolution
    batch = torch.empty((len(indices), h, w, 3), dtype=torch.uint8, pin_memory=pin_memory).permute(0, 3, 1, 2)
    if dataset.cache is None:
        return batch, torch.from_numpy(fill_decoded_batch(dataset, indices, rng, batch))
    fill_cached_batch(dataset, indices, rng, batch)
    return batch, torch.from_numpy(np.asarray(dataset.cache.labels[indices], dtype=np.int64))
