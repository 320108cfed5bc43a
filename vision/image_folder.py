"""ImageFolderFast: torchvision's ImageFolder indexing, OpenCV decoding, uint8 output, a decoded cache.

Use when: an ImageFolder tree (`root/<class>/<image>`) feeds a CNN/ViT and the CPU cannot
decode fast enough. Drop-in for `ImageFolder` + `Resize(256)` + `CenterCrop(224)` +
`PILToTensor` (eval) or `RandomResizedCrop(224)` + `RandomHorizontalFlip` (train); normalise
on the device with `DeviceNormalize`.
Cost per image: one file read, a header read, a DCT-scaled libjpeg-turbo decode of only the
resolution the output can use, a crop and one antialiased uint8 resize of the crop. With a
decoded cache (`build_image_cache`): a crop from a memory map.
Adapt here: override `find_classes` (as in torchvision), `CROP_PCT`/`SCALE`/`RATIO`, or pass
`transform=` for extra uint8 augmentation.
Trade-off: returns uint8 `[3, H, W]` (4x less memory and IPC than float32); normalisation
belongs on the GPU. Exact pixels differ from Pillow's by ~1-2 grey levels (crop before resize).

Why OpenCV in workers is safe here: OpenCV's thread pool is not fork-safe; a parent that used
cv2 with threads can hand forked workers a pool lock that is never released, and the loader
hangs with no error (pytorch#1355, #45198). `recipes.common.worker_init` (installed by
`make_loader`) switches cv2 to single-threaded in each worker before any decode.

The index (paths, targets) is held in `PackedStrings` and numpy arrays: no per-sample Python
objects for forked workers to copy on read.

The decoded cache (`build_image_cache`): every image decoded once, at the eval resize side S
(shorter side to S, a centred S x S square), into one uint8 file; warm epochs read
`[S, S, 3]` arrays from the page cache. `N * S * S * 3` bytes of disk (196 KB per image at
S=256: 250 GB for ImageNet-1k, so use it for subsets, smaller S, or fast local NVMe). Random
crops cannot reach the far ends of the longer side (as in FFCV's `max_resolution` stores).
Layout of `cache_dir/images-<fingerprint[:24]>/` (the `recipes.common.storage` protocol):
  header.json   {"format": "recipes-image-cache", "version", "fingerprint", "count", "side",
                 "skipped", "root"}
  labels.bin    int64 x N
  images.bin    uint8 x N x S x S x 3
  files.npy     per input file: path hash, size, mtime (names what changed in a stale cache)
The fingerprint covers the relative paths, sizes, mtimes, targets, S and decode settings; a
cache built from other inputs is never served: a warning names the changed files.

Copy this file with `recipes/common/storage.py` and `recipes/vision/decode.py`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.storage import (
    FolderBuild,
    LazyMap,
    PackedStrings,
    build_loader,
    check_size,
    fsync_path,
    read_header,
    resolve_index,
    sweep_dead_temps,
    write_synced,
)
from recipes.vision.decode import (
    CROP_PCT,
    RATIO,
    SCALE,
    ImageDecodeError,
    cache_tier_box,
    dct_reduction,
    decode_image,
    eval_box,
    new_uint8_batch,
    random_resized_box,
    resize_side,
    resize_uint8,
    scale_box,
    trim_heap,
)
from recipes.vision.decode import read_header as read_image_header

FORMAT = "recipes-image-cache"
FORMAT_VERSION = 2
_BUILD_HINT = "build_image_cache() or `recipes cache vision`"


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
            replaced by the next good one (deterministically) and counted in `skipped`.

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
    ):
        from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

        if on_error not in ("raise", "skip"):
            raise ValueError(f"`on_error` must be 'raise' or 'skip', but is {on_error!r} instead.")
        self.root = os.fspath(root)
        self.size = _as_size(size)
        self.train = train
        self.transform = transform
        self.on_error = on_error
        self.classes, self.class_to_idx = self.find_classes(self.root)
        if extensions is None and is_valid_file is None:
            extensions = IMG_EXTENSIONS
        samples = make_dataset(self.root, self.class_to_idx, extensions, is_valid_file)
        self._paths = PackedStrings(path for path, _ in samples)
        self._targets = np.fromiter((t for _, t in samples), np.int64, len(samples))
        del samples
        # Shared memory: visible to (persistent) workers after they started.
        self._resolution = torch.tensor(self.size, dtype=torch.int32).share_memory_()
        self._bad = torch.zeros(len(self._paths), dtype=torch.uint8).share_memory_()
        self._rng_pid: int | None = None
        self._rng: np.random.Generator | None = None
        self.cache: ImageCache | None = None
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        if self.cache_dir is not None:
            self._open_cache()

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
        self._resolution.copy_(torch.tensor(_as_size(size), dtype=torch.int32))

    # ---- errors and skips -------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Distinct bad files replaced so far, counted across worker processes."""
        return int(self._bad.sum())

    def skipped_indices(self) -> np.ndarray:
        return np.flatnonzero(self._bad.numpy())

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = self._check_index(index)
        if self.cache is not None:
            return self._from_cache(index)
        image, target, _ = self._load_or_skip(index, self._output_image)
        return image, target

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """A whole batch in one call. From the cache, each image is read (`preadv`) into a
        private scratch buffer and its crop written straight into one batch tensor (shared
        memory in a worker); the items are rows of that tensor, which `uint8_collate` returns
        without another copy."""
        if self.cache is None:
            items = [self[i] for i in indices]
            trim_heap()  # decode buffers fragment the heap; keep worker memory flat across epochs
            return items
        indices = [self._check_index(i) for i in indices]
        labels = self.cache.labels[indices]
        if self.transform is not None:  # the transform may change shapes: separate tensors
            arrays = self.cache.read_batch(indices)
            return [self._cached_item(a, int(t)) for a, t in zip(arrays, labels, strict=True)]
        out_h, out_w = self.resolution
        batch = new_uint8_batch(len(indices), 3, out_h, out_w)
        scratch = self._scratch()
        side = self.cache.side
        pure_crop = not self.train and (out_h, out_w) == self.size
        for row, index in enumerate(indices):
            if pure_crop:  # read only the crop's rows, copy only its columns
                top, left = int(round((side - out_h) / 2.0)), int(round((side - out_w) / 2.0))
                rows = self.cache.read_into(index, scratch[:out_h], first_row=top)
                batch[row].copy_(torch.from_numpy(rows[:, left : left + out_w]).permute(2, 0, 1))
            else:
                image, _ = self._cached_item(self.cache.read_into(index, scratch), 0)
                batch[row].copy_(image)
        return [(batch[row], int(t)) for row, t in enumerate(labels)]

    def _scratch(self) -> np.ndarray:
        """A per-process `[S, S, 3]` read buffer (never handed out: items are copied from it)."""
        if getattr(self, "_scratch_pid", None) != os.getpid():
            self._scratch_buf = np.empty((self.cache.side, self.cache.side, 3), np.uint8)
            self._scratch_pid = os.getpid()
        return self._scratch_buf

    def _check_index(self, index) -> int:
        return resolve_index(index, len(self), f"the {len(self)} images under {self.root}")

    def _load_or_skip(self, index: int, load):
        """`load(i)` for `index`, or with on_error="skip" the next good index after it."""
        n = len(self)
        for step in range(n):
            i = (index + step) % n
            try:
                return (*load(i), step > 0)
            except ImageDecodeError:
                if self.on_error == "raise":
                    raise
                self._bad[i] = 1
        raise ImageDecodeError(f"every one of the {n} images under {self.root} failed to decode")

    # ---- decoding from files ----------------------------------------------------------
    def _read(self, index: int):
        path = self._paths[index]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as error:
            raise ImageDecodeError(f"image {path!r} (index {index}) cannot be read: {error}") from None
        return path, data, read_image_header(data, path=path, index=index)

    def _output_image(self, index: int) -> tuple[torch.Tensor, int]:
        path, data, header = self._read(index)
        out = self.resolution
        if self.train:
            box = random_resized_box(header.height, header.width, self._generator(), self.SCALE, self.RATIO)
        else:
            box = eval_box(header.height, header.width, out, self.CROP_PCT)
        image = self._decode_box(data, header, box, out, path, index)
        return self._finish(resize_uint8(image, out)), int(self._targets[index])

    def _decode_box(self, data, header, box, out, path, index) -> np.ndarray:
        """Decodes at the coarsest DCT scale that keeps `box` at least `out`, then crops it."""
        reduce = dct_reduction((box[2], box[3]), out)
        decoded = decode_image(data, reduce=reduce, header=header, path=path, index=index)
        h, w = decoded.shape[:2]
        if (h, w) != (header.height, header.width):
            box = scale_box(box, h / header.height, w / header.width, h, w)
        top, left, bh, bw = box
        return decoded[top : top + bh, left : left + bw]

    def _cache_image(self, index: int) -> tuple[np.ndarray, int]:
        """`([S, S, 3] uint8, target)` at the cache geometry."""
        path, data, header = self._read(index)
        side = self.cache_side
        box = cache_tier_box(header.height, header.width, self.size, self.CROP_PCT)
        image = self._decode_box(data, header, box, (side, side), path, index)
        array = resize_uint8(image, (side, side)).permute(1, 2, 0).contiguous().numpy()
        return array, int(self._targets[index])

    # ---- the decoded cache ------------------------------------------------------------
    @property
    def cache_side(self) -> int:
        """S of the cache: the eval resize side of the constructor's `size` (224 -> 256)."""
        return resize_side(self.size, self.CROP_PCT)

    def cache_fingerprint(self) -> str:
        """sha256 of the inputs: relative paths, sizes, mtimes, targets, S and decode settings."""
        return self._cache_inputs()[0]

    def _cache_inputs(self) -> tuple[str, list[str], np.ndarray]:
        """`(fingerprint, relative paths, file table)`: one `stat` per file."""
        import hashlib

        import cv2

        digest = hashlib.sha256()
        settings = (f"v{FORMAT_VERSION}|S={self.cache_side}|size={self.size}|crop=tier|resize=bilinear-aa"
                    f"|cv2={cv2.__version__}")
        digest.update(settings.encode())
        rels, sizes, mtimes = [], [], []
        for path, target in zip(self._paths, self._targets.tolist(), strict=True):
            st = os.stat(path)
            rel = os.path.relpath(path, self.root)
            digest.update(f"\n{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{target}".encode("utf-8", "surrogateescape"))
            rels.append(rel)
            sizes.append(st.st_size)
            mtimes.append(st.st_mtime_ns)
        return digest.hexdigest(), rels, _file_table(rels, sizes, mtimes)

    def _open_cache(self) -> None:
        fingerprint, rels, table = self._cache_inputs()
        path = ImageCache.folder_for(self.cache_dir, fingerprint)
        if self.cache_dir.is_dir():
            sweep_dead_temps(self.cache_dir, path.name)  # a build killed midway leaves its temp folder
        if not path.exists():
            stale = _stale_caches(self.cache_dir, os.path.abspath(self.root), fingerprint) if self.cache_dir.is_dir() else []
            if stale:
                warnings.warn(f"Not using the image cache in {self.cache_dir}: it was built from other inputs "
                              f"({_describe_change(stale[-1], rels, table)}). Decoding from files, about 10x slower; "
                              "rebuild with build_image_cache() or `recipes cache vision`, which replaces it.",
                              stacklevel=3)
            return
        try:
            self._serve(ImageCache.open(path, fingerprint=fingerprint))
        except ImageCacheError as why:
            warnings.warn(f"Not using the image cache: {why} Decoding from files.", stacklevel=3)

    def _serve(self, cache: ImageCache) -> None:
        """Serves items from `cache` (checked against this dataset's size)."""
        if cache.count != len(self):
            raise ValueError(f"the cache holds {cache.count} images but the dataset has {len(self)}.")
        self.cache = cache
        for i in cache.skipped:
            self._bad[i] = 1

    def _from_cache(self, index: int) -> tuple[torch.Tensor, int]:
        return self._cached_item(self.cache.read_batch([index])[0], int(self.cache.labels[index]))

    def _cached_item(self, array: np.ndarray, target: int) -> tuple[torch.Tensor, int]:
        out = self.resolution
        side = array.shape[0]
        if self.train:
            box = random_resized_box(side, side, self._generator(), self.SCALE, self.RATIO)
        else:  # the tier's inner `size` crop is the eval crop; other resolutions resize it
            h, w = self.size
            box = (int(round((side - h) / 2.0)), int(round((side - w) / 2.0)), h, w)
        top, left, bh, bw = box
        return self._finish(resize_uint8(array[top : top + bh, left : left + bw], out)), target

    # ---- shared tail ------------------------------------------------------------------
    def _finish(self, image: torch.Tensor) -> torch.Tensor:
        if self.train and self._generator().random() < 0.5:
            image = image.flip(-1)
        return self.transform(image) if self.transform is not None else image

    def _generator(self) -> np.random.Generator:
        """Per-process generator seeded from torch's seed (base_seed + worker_id in workers)."""
        if self._rng_pid != os.getpid():
            self._rng = np.random.default_rng(torch.initial_seed())
            self._rng_pid = os.getpid()
        return self._rng

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_rng=None, _rng_pid=None, _scratch_buf=None, _scratch_pid=None)
        return state

    def __repr__(self) -> str:
        source = f"cache {self.cache.path}" if self.cache is not None else "files"
        return (f"ImageFolderFast(root={self.root!r}, n={len(self)}, classes={len(self.classes)}, "
                f"size={self.resolution}, train={self.train}, from {source})")


def _as_size(size) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if (not isinstance(size, tuple) or len(size) != 2
            or not all(isinstance(v, int) and v > 0 for v in size)):
        raise ValueError(f"`size` must be a positive int or an (h, w) tuple of them, but is {size!r} instead.")
    return size


# ---- the decoded cache -------------------------------------------------------------------
class ImageCacheError(ValueError):
    """A decoded-image cache that is missing, truncated, corrupt or built from other inputs."""


class ImageCache:
    """An opened, validated decoded-image cache folder; its files are mapped lazily per process."""

    def __init__(self, path: Path, header: dict):
        self.path, self.header = Path(path), header
        self.count, self.side = int(header["count"]), int(header["side"])
        self.fingerprint: str = header["fingerprint"]
        self.skipped: tuple[int, ...] = tuple(header["skipped"])
        # copy-on-write maps: writable views for torch.from_numpy; the files are never written
        self._labels = LazyMap(self.path / "labels.bin", "<i8", (self.count,), mode="c")
        self._images = LazyMap(self.path / "images.bin", np.uint8, (self.count, self.side, self.side, 3), mode="c")

    @staticmethod
    def folder_for(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
        return Path(cache_dir) / f"images-{fingerprint[:24]}"

    @classmethod
    def open(cls, path: str | os.PathLike, *, fingerprint: str | None = None) -> ImageCache:
        """Opens and validates a cache folder (header, file sizes).

        Raises:
            ImageCacheError: missing, truncated, corrupt, another format version, or (with
                `fingerprint`) built from other inputs; the message says to rebuild.
        """
        path = Path(path)
        header = read_header(path, fmt=FORMAT, version=FORMAT_VERSION, fingerprint=fingerprint,
                             error=ImageCacheError, build_hint=_BUILD_HINT,
                             fields=("fingerprint", "count", "side", "skipped"))
        try:
            count, side = int(header["count"]), int(header["side"])
            skipped = [int(i) for i in header["skipped"]]
        except (TypeError, ValueError):
            raise ImageCacheError(f"{path}/header.json has invalid fields; rebuild it with {_BUILD_HINT}.") from None
        if count < 0 or side <= 0 or any(not 0 <= i < count for i in skipped):
            raise ImageCacheError(f"{path}/header.json has invalid fields; rebuild it with {_BUILD_HINT}.")
        check_size(path / "labels.bin", 8 * count, ImageCacheError)
        check_size(path / "images.bin", count * side * side * 3, ImageCacheError)
        return cls(path, header)

    def read_into(self, index: int, out: np.ndarray, *, first_row: int = 0) -> np.ndarray:
        """Reads rows `first_row : first_row + len(out)` of image `index` into `out`
        (`uint8 [rows, S, 3]`, C-contiguous) with one `preadv`; returns `out`."""
        row_bytes = self.side * 3
        return self._images.read_into(out, (int(index) * self.side + first_row) * row_bytes)

    def read_batch(self, indices) -> np.ndarray:
        """Images `[B, S, S, 3]` for `indices`, copied by `preadv` into one fresh array.

        A read copies from the page cache in the kernel; touching a memory map instead costs
        a page fault per 4 KiB in every new worker process, which is slower on warm epochs.
        """
        per_image = self.side * self.side * 3
        out = np.empty((len(indices), self.side, self.side, 3), np.uint8)
        for row, index in enumerate(indices):
            self._images.read_into(out[row], int(index) * per_image)
        return out

    @property
    def images(self) -> np.ndarray:
        """`uint8 [N, S, S, 3]` memory map."""
        return self._images.array

    @property
    def labels(self) -> np.ndarray:
        """`int64 [N]` memory map."""
        return self._labels.array

    def __repr__(self) -> str:
        return f"ImageCache({str(self.path)!r}, n={self.count}, side={self.side})"


def build_image_cache(dataset: ImageFolderFast, cache_dir: str | os.PathLike, *, num_workers: int | None = None,
                      progress: bool = True, distributed: bool = False) -> ImageCache:
    """Decodes every image of an `ImageFolderFast` once into a memory-mapped cache.

    Images are decoded in parallel DataLoader workers at the dataset's `cache_side` S (shorter
    side resized to S, a centred S x S square), with a tqdm bar, into a temp folder renamed
    into place when complete. An existing valid cache is reused; caches of the same tree
    built from other inputs are removed. The dataset reads the cache from then on.

    Args:
        dataset: an `ImageFolderFast`.
        cache_dir: the folder for caches (created).
        num_workers: decode workers per rank; `smart_num_workers()` when None.
        progress: show a progress bar (on rank 0).
        distributed: split the decoding over the ranks of the initialised process group (every
            rank must make the same call); rank 0 publishes once all have written their share.
            `cache_dir` must be writable by every rank (a shared file system across nodes).

    Returns:
        The opened `ImageCache`.

    Raises:
        ImageDecodeError: a bad image when the dataset has `on_error="raise"` (with "skip",
            the next good image is stored in its place and the index is recorded).
    """
    fingerprint, _, table = dataset._cache_inputs()
    target = ImageCache.folder_for(cache_dir, fingerprint)
    build = FolderBuild(target, distributed=distributed)
    if build.needed(lambda: ImageCache.open(target, fingerprint=fingerprint), ImageCacheError):
        n, side = len(dataset), dataset.cache_side
        with build:
            if build.rank == 0:
                with open(build.path / "images.bin", "wb") as f:
                    f.truncate(n * side * side * 3)
            build.barrier()  # the file exists at full size: each rank writes its block in place
            images = np.memmap(build.path / "images.bin", np.uint8, "r+", shape=(n, side, side, 3))
            block = build.block(n)
            labels, skipped = _decode_into(dataset, images, block, num_workers, progress and build.rank == 0)
            images.flush()
            del images
            write_synced(build.part("labels.bin"), labels.astype("<i8").tobytes())
            build.concat("labels.bin")
            skipped = sorted(i for part in build.gather(skipped) for i in part)
            if build.rank == 0:
                fsync_path(build.path / "images.bin")
                with open(build.path / "files.npy", "wb") as f:
                    np.save(f, table, allow_pickle=False)
            build.publish({"format": FORMAT, "version": FORMAT_VERSION, "fingerprint": fingerprint, "count": n,
                           "side": side, "skipped": skipped, "root": os.path.abspath(dataset.root)})
    if build.rank == 0:  # replaced, not left beside it
        for stale in _stale_caches(Path(cache_dir), os.path.abspath(dataset.root), fingerprint):
            _remove_cache(stale)
    cache = ImageCache.open(target, fingerprint=fingerprint)
    dataset._serve(cache)
    return cache


class _CacheItems:
    """Items `(index, [S, S, 3] array, target, skipped)` of `block`, for the cache build."""

    def __init__(self, dataset: ImageFolderFast, block: range):
        self.dataset, self.block = dataset, block

    def __len__(self) -> int:
        return len(self.block)

    def __getitem__(self, position: int):
        index = self.block[position]
        return (index, *self.dataset._load_or_skip(index, self.dataset._cache_image))


def _as_numpy_batch(batch):
    index, arrays, targets, skipped = zip(*batch, strict=True)
    return np.asarray(index), np.stack(arrays), np.asarray(targets), np.asarray(skipped, bool)


def _decode_into(dataset, images: np.ndarray, block: range, num_workers: int | None, progress: bool):
    """Decodes `block` into `images`; returns `(labels of the block, skipped indices)`."""
    from tqdm import tqdm

    labels = np.zeros(len(block), np.int64)
    skipped: list[int] = []
    loader = build_loader(_CacheItems(dataset, block), num_workers=num_workers, batch_size=16,
                          collate_fn=_as_numpy_batch)
    with tqdm(total=len(block), disable=not progress, desc="decoding images", unit="img") as bar:
        for index, arrays, targets, was_skipped in loader:
            images[index] = arrays
            labels[index - block.start] = targets
            skipped.extend(index[was_skipped].tolist())
            bar.update(len(index))
    return labels, skipped


# ---- which files a cache was built from (to name what changed in a stale one) ----------
_MAX_NAMED = 5
_FILES = np.dtype([("path", "<i8"), ("size", "<i8"), ("mtime", "<i8")])
_LEGACY_MAGIC = b"RCPIMG01"  # format 1: one file `images-<fp>.bin` with a 4 KiB header


def _file_table(rel_paths: list[str], sizes: list[int], mtimes: list[int]) -> np.ndarray:
    """One row per input file: a hash of its relative path, its size and mtime (ns)."""
    import hashlib

    table = np.empty(len(rel_paths), _FILES)
    table["path"] = [int.from_bytes(hashlib.blake2b(p.encode("utf-8", "surrogateescape"), digest_size=8).digest(),
                                    "little", signed=True) for p in rel_paths]
    table["size"], table["mtime"] = sizes, mtimes
    return table


def _stale_caches(cache_dir: Path, root: str, fingerprint: str) -> list[Path]:
    """Caches in `cache_dir` built from this `root` but from other inputs (or an older format)."""
    import json

    found = []
    for path in sorted(Path(cache_dir).glob("images-*")):
        try:
            if path.is_dir():
                header = json.loads((path / "header.json").read_text())
            elif path.suffix == ".bin":
                with open(path, "rb") as f:
                    raw = f.read(4096)
                header = json.loads(raw[len(_LEGACY_MAGIC):].decode("utf-8")) if raw.startswith(_LEGACY_MAGIC) else {}
            else:
                continue
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(header, dict) and header.get("root") == root and (
                header.get("fingerprint") != fingerprint or not path.is_dir()):
            found.append(path)
    return found


def _sidecar(cache: Path) -> Path:
    return cache / "files.npy" if cache.is_dir() else cache.with_name(cache.name.removesuffix(".bin") + ".files.npy")


def _remove_cache(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        for p in (path, _sidecar(path)):
            p.unlink(missing_ok=True)


def _describe_change(old_cache: Path, rel_paths: list[str], table: np.ndarray) -> str:
    """What differs between the files `old_cache` was built from and the current ones."""
    try:
        old = np.load(_sidecar(old_cache), allow_pickle=False)
    except (OSError, ValueError):
        return f"{old_cache.name} was built from other inputs (no file list to compare)"
    before = {int(h): (int(s), int(m)) for h, s, m in zip(old["path"], old["size"], old["mtime"], strict=True)}
    added, changed = [], []
    for rel, (h, s, m) in zip(rel_paths, table.tolist(), strict=True):
        if h not in before:
            added.append(rel)
        elif before.pop(h) != (s, m):
            changed.append(rel)
    parts = [f"{len(old):,} files when built, {len(table):,} now"]
    for label, names in (("added", added), ("changed (size or mtime)", changed)):
        if names:
            shown = ", ".join(names[:_MAX_NAMED]) + (", ..." if len(names) > _MAX_NAMED else "")
            parts.append(f"{len(names):,} {label}: {shown}")
    if before:
        parts.append(f"{len(before):,} removed")
    if len(parts) == 1:
        parts.append("the same files, but other labels, decode settings or an older cache format")
    return f"{old_cache.name}: " + "; ".join(parts)
