"""ImageFolderFast: torchvision's ImageFolder indexing, OpenCV decoding, uint8 output, a decoded
cache.

Use when: an ImageFolder tree (`root/<class>/<image>`) feeds a CNN/ViT and the CPU cannot
decode fast enough. Drop-in for `ImageFolder` + `Resize(256)` + `CenterCrop(224)` +
`PILToTensor` (eval) or `RandomResizedCrop(224)` + `RandomHorizontalFlip` (train); normalise
on the device with `DeviceNormalize`.
Cost per image: one file read, a header read, a DCT-scaled libjpeg-turbo decode of only the
resolution the output can use, a crop and one antialiased uint8 resize of the crop. `strict`
(the default) checks each file's first decode for libjpeg's corrupt-data warnings (an
`ImageDecodeError`): ~5 us, or for a region decode the rows below the crop, once per file.
With a decoded cache (`build_image_cache`): a crop from a memory map.
Adapt here: override `find_classes` (as in torchvision), `CROP_PCT`/`SCALE`/`RATIO`, or `transform=`
(uint8). Trade-off: returns uint8 `[3, H, W]` (4x less memory and IPC than float32); normalisation
belongs on the GPU. Pixels differ from Pillow's by 1-5 grey levels (crop before resize).

OpenCV's thread pool is not fork-safe (a hang with no error: pytorch#1355, #45198): `decode_image`
and `worker_init` make cv2 single-threaded in each worker before any decode.
The index (paths, targets) is held in `PackedStrings` and numpy arrays: no per-sample Python objects
for forked workers to copy on read. The decoded cache (`recipes.vision.cache`) reads this dataset
as a `CacheSource`; threads read batches through `batches/thread_batches.py`.
Copy with: common/caches/build_ranks.py, common/caches/cache_builds.py,
  common/caches/cache_checks.py, common/caches/cache_files.py, common/caches/packed_strings.py,
  common/loader_warning.py, common/loading/batch_ring.py, common/loading/build_loader.py,
  common/loading/epoch_read_ahead.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py,
  vision/batches/batch_buffers.py, vision/batches/device.py, vision/batches/gpu_decode.py,
  vision/batches/thread_batches.py, vision/cache/cache_source.py, vision/cache/cached_batches.py,
  vision/cache/cached_items.py, vision/cache/eval_view.py, vision/cache/eval_view_build.py,
  vision/cache/image_cache.py, vision/cache/image_cache_build.py, vision/cache/stale_caches.py,
  vision/decoding/bad_files.py, vision/decoding/crop.py, vision/decoding/decode.py,
  vision/decoding/image_header.py, vision/decoding/jpeg_damage.py, vision/decoding/region_decode.py,
  vision/folder_index.py.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.caches.packed_strings import PackedStrings, resolve_index
from recipes.vision.batches.batch_buffers import new_uint8_batch, trim_heap
from recipes.vision.batches.device import uint8_collate
from recipes.vision.batches.gpu_decode import encoded_item
from recipes.vision.batches.thread_batches import (
    ReadAheadKey,
    batch_of,
    items_of,
    read_ahead_key_of,
)
from recipes.vision.cache.cached_items import CachedItems
from recipes.vision.cache.eval_view import EvalView
from recipes.vision.cache.eval_view_build import eval_record_of
from recipes.vision.cache.image_cache import ImageCache
from recipes.vision.cache.image_cache_build import attach_image_cache, cache_inputs, decode_stored
from recipes.vision.decoding.bad_files import BadFiles
from recipes.vision.decoding.crop import (
    CROP_PCT,
    RATIO,
    SCALE,
    CropSettings,
    eval_box,
    output_size,
    random_resized_box,
)
from recipes.vision.decoding.decode import resize_uint8
from recipes.vision.decoding.image_header import read_image_file
from recipes.vision.decoding.region_decode import decode_box
from recipes.vision.folder_index import checked_settings, index_folder


class ImageFolderFast(Dataset):
    """An ImageFolder that yields `(uint8 [3, H, W] RGB tensor, int target)`.

    Args:
        root: the dataset root, `root/<class>/<image>`.
        size: output side (or `(h, w)`); `set_resolution` changes it later.
        train: random-resized-crop and horizontal flip when True; resize-and-centre-crop when False.
        cache_dir: a folder with (or for) a decoded-image cache; served when its fingerprint
            matches this tree, else a warning and decoding from files.
        extensions: accepted suffixes (torchvision's `IMG_EXTENSIONS` by default).
        is_valid_file: a predicate on paths, instead of `extensions`.
        transform: a callable on the uint8 tensor, applied last.
        on_error: `"raise"` an `ImageDecodeError` for a bad file, or `"skip"` it: the item is
            replaced by the next good one (deterministically) and counted in `skipped`. A bad
            file draws no crop or flip: the next good one gets what it would have got, on the
            CPU path as with decode="gpu".
        strict: a JPEG whose entropy data libjpeg-turbo finds damaged (and recovers from with
            made-up pixels) is a bad file (`recipes.vision.decoding.decode`). Each file is checked
            the first time any worker decodes it (a shared flag per file), so later epochs decode as
            without the check. False: served as decoded. With decode="gpu" only the files decoded on
            the CPU are checked: nvJPEG reports no such damage.
        max_side: the decoded cache stores each whole image, aspect kept, with its longer side
            at most this (FFCV's `max_resolution`); default 2 x the larger side of `size`.
        decode: "cpu" (uint8 crops from the workers), or "gpu": workers only read the file bytes
            and draw the crop and flip (seeded, as on the CPU); `GpuDecode` decodes, crops,
            resizes and normalises whole batches on the device (collate with `encoded_collate`).
        region_decode: decode only the crop of a JPEG (libjpeg-turbo's cropped decode through
            nvImageCodec's CPU backend, `pip install "loader-recipes[roi]"`; same pixels). None:
            when nvImageCodec is installed; True: require it. Crops small enough for a 1/2, 1/4 or
            1/8 DCT-scaled decode use that instead. A strict first decode of a file reads on to the
            bottom of the image (what region decode saves), later ones only the crop.

    Raises:
        FileNotFoundError: no class folders or no valid files (torchvision's errors).
        ValueError: invalid arguments.

    Example:
        >>> ds = ImageFolderFast("/data/imagenet/val", size=224)
        >>> image, target = ds[0]  # uint8 [3, 224, 224]
    """

    CROP_PCT = CROP_PCT
    SCALE = SCALE
    RATIO = RATIO

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        size: int | tuple[int, int] = 224,
        train: bool = False,
        cache_dir: str | os.PathLike | None = None,
        extensions: tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        max_side: int | None = None,
        decode: Literal["cpu", "gpu"] = "cpu",
        region_decode: bool | None = None,
        strict: bool = True,
    ):
        self.root = os.fspath(root)
        settings = checked_settings(
            size,
            on_error=on_error,
            decode=decode,
            transform=transform,
            cache_dir=cache_dir,
            region_decode=region_decode,
            max_side=max_side,
        )
        self.size = settings.size
        self.decode = decode
        self.region_decode = region_decode
        self.max_side = settings.max_side
        self.train = train
        self.transform = transform
        self.on_error = on_error
        self.strict = bool(strict)
        self.classes, self.class_to_idx = self.find_classes(self.root)
        index = index_folder(self.root, self.class_to_idx, extensions, is_valid_file)
        self._paths = index.paths
        self._targets = index.targets
        # Shared memory: visible to (persistent) workers after they started.
        self._resolution = torch.tensor(self.size, dtype=torch.int32).share_memory_()
        self._bad = BadFiles(len(self._paths), f"the {len(self._paths)} images under {self.root}")
        # strict: 1 once a file's first decode was checked
        self._checked = torch.zeros(len(self._paths), dtype=torch.uint8).share_memory_()
        self._rng_key = None  # (pid, torch seed) of the draws' np.random.Generator
        self._rng = None
        self._cached: CachedItems | None = None  # set by use_cache
        self.cache_dir = settings.cache_dir
        if self.cache_dir is not None:
            attach_image_cache(self.cache_dir, self)

    # torchvision's hook, same signature and errors.
    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        from torchvision.datasets.folder import find_classes

        return find_classes(directory)

    def __len__(self) -> int:
        return len(self._paths)

    @property
    def targets(self) -> np.ndarray:
        """`int64 [N]` class indices, in `samples` order."""
        return self._targets

    @property
    def samples(self) -> list[tuple[str, int]]:
        """torchvision's `samples` list, built on access (the dataset itself holds arrays)."""
        return list(zip(self._paths, self._targets.tolist(), strict=True))

    imgs = samples

    @property
    def paths(self) -> PackedStrings:
        return self._paths

    # ---- resolution -------------------------------------------------------------------
    @property
    def resolution(self) -> tuple[int, int]:
        return tuple(int(v) for v in self._resolution.tolist())

    def set_resolution(self, size: int | tuple[int, int]) -> None:
        """Changes the output size, in shared memory (reaches persistent workers)."""
        self._resolution.copy_(torch.tensor(output_size(size), dtype=torch.int32))

    # ---- errors and skips -------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Distinct bad files replaced so far, counted across worker processes."""
        return self._bad.count

    def skipped_indices(self) -> np.ndarray:
        return self._bad.indices()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = self._check_index(index)
        if self.decode == "gpu":
            item, target, _ = self._load_or_skip(index, self._encoded_item)
            return item, target
        if self._cached is not None:
            image = self._cached.item(index, self.crop_settings(), self._generator())
            return self._finish(image), int(self._cached.cache.labels[index])
        image, target, _ = self._load_or_skip(index, self._output_image)
        return image, target

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """A whole batch in one call. From the cache, each crop is read (`preadv`) and resized
        straight into one batch tensor (shared memory in a worker); the items are rows of that
        tensor, which `uint8_collate` returns without another copy (`fill_cached_batch`)."""
        if self._cached is None:
            items = [self[i] for i in indices]
        elif self.transform is not None:  # a transform may change shapes: separate tensors
            # every index checked before the first read: a refused batch draws no crop or flip
            indices = [self._check_index(i) for i in indices]
            items = [self[i] for i in indices]
        else:
            indices = [self._check_index(i) for i in indices]
            batch = new_uint8_batch(len(indices), 3, *self.resolution)
            items = self._cached.items(indices, self.crop_settings(), self._generator(), batch)
        if self._cached is not None or self.decode == "cpu":
            trim_heap()  # decode buffers fragment the heap; keep worker memory flat across epochs
        return items

    # ---- the thread path (ThreadLoader, which make_loader chooses) ----------------------
    def thread_batches(self) -> bool:
        """Whether threads can make its batches: no `transform` (Python per item, holding the GIL)
        and decode="cpu" (a `preadv` or a read and a decode, then a resize: all release the GIL)."""
        return self.transform is None and self.decode == "cpu"

    def read_batch(
        self, indices: list[int], rng: np.random.Generator, *, pin_memory: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(images uint8 [B, 3, H, W] channels-last, targets int64 [B])`, made by the calling
        thread, crops and flips drawn from `rng` (`thread_batches.batch_of`)."""
        return batch_of(self, indices, rng, pin_memory=pin_memory)

    def read_items(
        self, indices: list[int], rng: np.random.Generator
    ) -> list[tuple[torch.Tensor, int]]:
        """`read_batch`'s items, for a collate function of the user's (`thread_batches`)."""
        return items_of(self, indices, rng)

    def read_ahead_key(self) -> ReadAheadKey:
        """What its batches depend on besides indices and generator (`thread_batches`)."""
        return read_ahead_key_of(self)

    @property
    def read_batch_collate(self) -> Callable:
        """`uint8_collate`: `read_batch` returns what it would, so make_loader keeps threads."""
        return uint8_collate

    def crop_settings(self) -> CropSettings:
        """The crops its items get now: train or eval, at the current resolution."""
        return CropSettings(self.train, self.resolution, self.SCALE, self.RATIO, self.CROP_PCT)

    def read_item(
        self, index: int, rng: np.random.Generator, *, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """`(uint8 [3, H, W], target)` decoded from its file (or the replacement `on_error` picks),
        crop and flip drawn from `rng`; with `into` (a batch row, no `transform`) resized into it.
        """
        image, target, _ = self._load_or_skip(
            index, functools.partial(self._output_image, rng=rng, into=into), rng
        )
        return image, target

    def _check_index(self, index) -> int:
        return resolve_index(index, len(self), f"the {len(self)} images under {self.root}")

    def _load_or_skip(self, index: int, load, rng: np.random.Generator | None = None):
        """`load(i)` for `index`, or with on_error="skip" the next good index after it, a bad file
        consuming no randomness of `rng` (else this process's generator): `BadFiles.load`."""
        rng = rng or self._generator()
        return self._bad.load(index, load, rng, on_error=self.on_error, rewind=self.train)

    # ---- decoding from files ----------------------------------------------------------
    def _read(self, index: int):
        path = self._paths[index]
        return (path, *read_image_file(path, index=index))

    def _output_image(
        self,
        index: int,
        rng: np.random.Generator | None = None,
        *,
        into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int]:
        """`(uint8 [3, H, W], target)` decoded from the file, crop and flip drawn from `rng`
        (this process's generator when None). With `into` (a batch row; no `transform`), the
        image is resized (and flipped) straight into it and `into` returned."""
        rng = rng or self._generator()
        path, data, header = self._read(index)
        size = self.resolution
        if self.train:
            box = random_resized_box(header.height, header.width, rng, self.SCALE, self.RATIO)
        else:
            box = eval_box(header.height, header.width, size, self.CROP_PCT)
        image = self._decode_box(data, header, box, size, path, index)
        if into is None or self.transform is not None:
            return self._finish(resize_uint8(image, size), rng), int(self._targets[index])
        mirror = self.train and rng.random() < 0.5  # the flip `_finish` would draw
        return resize_uint8(image, size, out=into, mirror=mirror), int(self._targets[index])

    def _encoded_item(self, index: int) -> tuple[dict, int]:
        """decode="gpu": the file's bytes, crop box and flip (`gpu_decode.encoded_item`)."""
        path, data, header = self._read(index)
        item = encoded_item(
            data, header, self.crop_settings(), self._generator(), path=path, index=index
        )
        return item, int(self._targets[index])

    def _decode_box(self, data: bytes, header, box, out, path: str, index: int) -> np.ndarray:
        """The pixels of `box`: a region or DCT-scaled decode (`region_decode.decode_box`), a
        file's first decode checked with `strict`."""
        checked = None
        if self.strict:
            checked = self._checked
        return decode_box(
            data, header, box, out, path, index, checked=checked, region_decode=self.region_decode
        )

    def _cache_image(self, index: int) -> tuple[np.ndarray, int]:
        """`([h, w, 3] uint8, target)`: the whole image, its longer side at most `max_side`."""
        path, data, header = self._read(index)
        image = decode_stored(
            data, header, self.max_side, strict=self.strict, path=path, index=index
        )
        return image, int(self._targets[index])

    # ---- the decoded cache ------------------------------------------------------------
    def cache_fingerprint(self) -> str:
        """sha256 of the inputs: relative paths, sizes, mtimes, targets, S and decode settings."""
        return cache_inputs(self._paths, self._targets, self.root, self.max_side)[0]

    def cache_record(self, index: int) -> tuple[np.ndarray, int, bool]:
        """What `build_image_cache` stores at `index`: `(uint8 [h, w, 3], target, skipped)` from
        `_cache_image`, or with on_error="skip" for a bad file the next good image's."""
        return self._load_or_skip(index, self._cache_image)

    def use_cache(self, cache: ImageCache) -> None:
        """Serves items from `cache` (`build_image_cache` calls it; eval views opened before are
        dropped), checked against this dataset's size and targets.

        Raises:
            ImageCacheError: `labels.bin` disagrees with the targets.
        """
        self._cached = CachedItems(cache, self._targets)
        self._bad.mark(cache.skipped)

    @property
    def cache(self) -> ImageCache | None:
        """The decoded cache its items are served from (`use_cache`); None: from the files."""
        if self._cached is None:
            return None
        return self._cached.cache

    @property
    def eval_view(self) -> EvalView | None:
        """The cache's eval view at the current resolution (eval mode only), opened once per
        resolution and process (`CachedItems.eval_view`, which warns when there is none)."""
        if self._cached is None:
            return None
        return self._cached.eval_view(self.crop_settings())

    def eval_record(self, index: int) -> torch.Tensor:
        """What an eval view stores at `index` (`eval_record_of` its file; with
        on_error="skip", of the next good file's). torchvision's eval pixels, not the uncached
        file path's: that one crops, then resizes the crop (a box rounded to whole source
        pixels), a mean ~2 grey levels away and more at edges."""
        if self.train:
            raise ValueError(
                "eval_record is what evaluation sees, but this dataset has train=True."
            )

        def load(i: int):
            record = eval_record_of(
                *self._read(i), self.resolution, self.CROP_PCT, index=i, strict=self.strict
            )
            return record, int(self._targets[i])

        return self._load_or_skip(index, load)[0]

    # ---- shared tail ------------------------------------------------------------------
    def _finish(self, image: torch.Tensor, rng: np.random.Generator | None = None) -> torch.Tensor:
        if self.train and (rng or self._generator()).random() < 0.5:
            image = image.flip(-1)
        if self.transform is None:
            return image
        return self.transform(image)

    def _generator(self) -> np.random.Generator:
        """Crop and flip draws, seeded from torch's seed when it changes: base_seed + worker_id
        in a DataLoader's workers, each batch's seed in a resumable loader's (exact resume)."""
        key = (os.getpid(), torch.initial_seed())
        if self._rng_key != key:
            self._rng = np.random.default_rng(key[1])
            self._rng_key = key
        return self._rng

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_rng=None, _rng_key=None)
        return state

    def __repr__(self) -> str:
        source = "files"
        if self.cache is not None:
            source = f"cache {self.cache.path}"
        return (
            f"ImageFolderFast(root={self.root!r}, n={len(self)}, classes={len(self.classes)}, "
            f"size={self.resolution}, train={self.train}, from {source})"
        )
