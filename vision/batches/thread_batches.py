"""Whole batches of an `ImageFolderFast` made by threads of the training process (`ThreadLoader`).

Use when: `make_loader` picks the thread path (`thread_batches()` is true: no `transform`,
decode="cpu"); `ImageFolderFast.read_batch`, `read_items` and `read_ahead_key` call these
functions (`batch_of`, `items_of`, `read_ahead_key_of`). Each batch is
one uint8 `[B, 3, H, W]` tensor (channels-last in memory), filled row by row: from the decoded
cache when one is attached (`fill_cached_batch`: a `preadv` and a resize, or an eval view's row),
else decoded from the files, each image resized (and flipped) straight into its row.
Cost: per image what the worker path pays, without IPC: no shared-memory hand-over, no pickling;
the GIL is released in the reads, decodes and resizes.
Adapt here: nothing; the crops are the dataset's (`crop_settings()`).
Trade-off: Python per image still holds the GIL (the crop draws, the loop): on many cores the
rate per thread falls; workers (`make_loader(..., path="workers")`) scale further.
It reads the dataset through its public side: `thread_batches()`, `len()`, `root`,
`resolution`, `cache`, `eval_view`, `crop_settings()` and `read_item(i, rng, into=)`.
Copy with: common/caches/cache_checks.py, common/caches/cache_files.py,
  common/caches/packed_strings.py, common/loading/batch_ring.py, common/loading/epoch_read_ahead.py,
  common/workers/held_descriptors.py, vision/batches/batch_buffers.py,
  vision/cache/cached_batches.py, vision/cache/eval_view.py, vision/cache/image_cache.py,
  vision/decoding/crop.py, vision/decoding/decode.py, vision/decoding/image_header.py,
  vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recipes.common.caches.packed_strings import resolve_index
from recipes.common.loading.batch_ring import slot_tensor
from recipes.common.loading.epoch_read_ahead import ByIdentity
from recipes.vision.batches.batch_buffers import trim_heap
from recipes.vision.cache.cached_batches import fill_cached_batch
from recipes.vision.decoding.crop import CropSettings


def batch_of(
    dataset, indices: list[int], rng: np.random.Generator, *, pin_memory: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`read_batch(indices, rng)`: `(images uint8 [B, 3, H, W] channels-last, targets int64 [B])`,
    what `uint8_collate` returns for the same items, crops and flips drawn from `rng`, from the
    cache when one is attached, else decoded from the files; safe to call from several threads
    at once. With `pin_memory` (CUDA), the batch is filled in place in page-locked memory from
    torch's caching host allocator (blocks are reused once their copies to the device are
    done): no second copy into pinned memory."""
    if not dataset.thread_batches():
        raise ValueError(
            "read_batch makes batches in threads, which a `transform` (Python per item) or "
            "decode='gpu' rule out; use DataLoader workers (make_loader(..., path='workers'))."
        )
    indices = [
        resolve_index(i, len(dataset), f"the {len(dataset)} images under {dataset.root}")
        for i in indices
    ]
    h, w = dataset.resolution
    shape = (len(indices), h, w, 3)
    batch = _batch_tensor(shape, pin_memory).permute(0, 3, 1, 2)
    if dataset.cache is None:
        targets = np.empty(len(indices), np.int64)
        for row, index in enumerate(indices):  # resized into the row (no transform on this path)
            _, targets[row] = dataset.read_item(index, rng, into=batch[row])
        trim_heap()  # decode buffers fragment the heap (batch_buffers.trim_heap)
        return batch, torch.from_numpy(targets)
    fill_cached_batch(
        dataset.cache, dataset.eval_view, dataset.crop_settings(), indices, rng, batch
    )
    return batch, torch.from_numpy(np.asarray(dataset.cache.labels[indices], dtype=np.int64))


def _batch_tensor(shape: tuple[int, ...], pin_memory: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor of `shape`: pinned with `pin_memory`, else in the isolated
    loader's slot when there is one (no copy), else plain."""
    if not pin_memory:
        made = slot_tensor(shape, torch.uint8)
        if made is not None:
            return made
    return torch.empty(shape, dtype=torch.uint8, pin_memory=pin_memory)


def items_of(
    dataset, indices: list[int], rng: np.random.Generator
) -> list[tuple[torch.Tensor, int]]:
    """`read_batch`'s items, `(image, target)` each (rows of one batch tensor), for a collate
    function of the user's on the thread path: the same draws from `rng`."""
    images, targets = batch_of(dataset, indices, rng)
    return [(images[row], int(t)) for row, t in enumerate(targets.tolist())]


@dataclass(frozen=True)
class ReadAheadKey:
    """What `ImageFolderFast`'s batches depend on besides their indices and generator
    (`loader_contract.ReadAheadKeyed`): the crops' settings (the resolution in them), the cache
    attached (the object itself: a new one never compares equal), the error policy, the
    decoder and checksums of the targets and the cache's labels (rewritten in place). The thread
    paths make the next epoch's first batches ahead while it stays the same. A subclass whose
    batches depend on more adds it to its own key."""

    dataset_type: type
    root: str
    crops: CropSettings
    cache: ByIdentity
    cache_dir: Path | None
    on_error: str
    strict: bool
    max_side: int
    region_decode: bool | None
    decode: str
    no_transform: bool
    targets_crc: int
    # the cache's labels are the cached path's: checked as the targets are (pseudo-labelling)
    labels_crc: int | None


def read_ahead_key_of(dataset) -> ReadAheadKey:
    """`ImageFolderFast.read_ahead_key()`: its `ReadAheadKey` now; called from the pool's
    threads too (as each read ahead starts and ends): cheap, no side effects."""
    cache = dataset.cache
    labels_crc = None
    if cache is not None:
        labels_crc = zlib.crc32(cache.labels)
    return ReadAheadKey(
        dataset_type=type(dataset),
        root=dataset.root,
        crops=dataset.crop_settings(),
        cache=ByIdentity(cache),
        cache_dir=dataset.cache_dir,
        on_error=dataset.on_error,
        strict=dataset.strict,
        max_side=dataset.max_side,
        region_decode=dataset.region_decode,
        decode=dataset.decode,
        no_transform=dataset.transform is None,
        targets_crc=zlib.crc32(dataset.targets),
        labels_crc=labels_crc,
    )
