"""ImageFolderFast: torchvision's ImageFolder indexing, OpenCV decoding, uint8 output, a decoded cache.

Use when: an ImageFolder tree (`root/<class>/<image>`) feeds a CNN/ViT and the CPU cannot
decode fast enough. Drop-in for `ImageFolder` + `Resize(256)` + `CenterCrop(224)` +
`PILToTensor` (eval) or `RandomResizedCrop(224)` + `RandomHorizontalFlip` (train); normalise
on the device with `DeviceNormalize`.
Cost per image: one file read, a header read, a DCT-scaled libjpeg-turbo decode of only the
resolution the output can use, a crop and one antialiased uint8 resize of the crop. `strict`
(the default) checks each file's first decode for libjpeg's corrupt-data warnings (an
`ImageDecodeError`): ~5 us, or for a region decode the rows below the crop, once per file.
With a decoded cache (`build_image_cache`): a crop from a memory map.
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

The decoded cache (`build_image_cache`): every image decoded once and stored whole, its aspect
kept and its longer side at most `max_side` (FFCV's `max_resolution`; default 2 x size), in one
uint8 file of variable-size records. Train crops are drawn over the whole stored image, so they
follow torchvision's `RandomResizedCrop` on the original (scale and ratio relative to its area
and aspect) and reach its borders; eval crops come from the same record. Only a crop's rows
are read. About `max_side^2 * 3 * 0.75` bytes per 4:3 image (450 KB at 448: use local NVMe,
or a smaller `max_side` for large datasets).
Layout of `cache_dir/images-<fingerprint[:24]>/` (the `recipes.common.cache_files` protocol):
  header.json   {"format": "recipes-image-cache", "version", "fingerprint", "count",
                 "max_side", "skipped", "root"}
  labels.bin    int64 x N
  shapes.bin    int32 x N x 2 (h, w of each stored image)
  offsets.bin   int64 x (N + 1): image i is bytes offsets[i]:offsets[i + 1], [h, w, 3] uint8
  images.bin    the images back to back
  files.npy     per input file: path hash, size, mtime (names what changed in a stale cache)
The fingerprint covers the relative paths, sizes, mtimes, targets, `max_side` and decode
settings; a cache built from other inputs is never served: a warning names the changed files.
A dataset attaching a cache compares `labels.bin` with its targets (one array compare; a
skipped index holds the label of the image stored in its place): a damaged label file is not
served either.

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

from recipes.common.cache_files import (
    FolderBuild,
    LazyMap,
    build_loader,
    check_size,
    read_header,
    sweep_dead_temps,
    write_synced,
)
from recipes.common.packed_strings import PackedStrings, resolve_index
from recipes.vision.decode import (
    CROP_PCT,
    RATIO,
    SCALE,
    ImageDecodeError,
    check_encoded,
    copy_image,
    dct_reduction,
    decode_image,
    decode_region,
    eval_box,
    new_uint8_batch,
    random_resized_box,
    region_decode_available,
    resize_uint8,
    scale_box,
    trim_heap,
)
from recipes.vision.decode import read_header as read_image_header

FORMAT = "recipes-image-cache"
FORMAT_VERSION = 3
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
            replaced by the next good one (deterministically) and counted in `skipped`. A bad
            file draws no crop or flip: the next good one gets what it would have got, on the
            CPU path as with decode="gpu".
        strict: a JPEG whose entropy data libjpeg-turbo finds damaged (and recovers from with
            made-up pixels) is a bad file (`recipes.vision.decode`). Each file is checked the
            first time any worker decodes it (a shared flag per file), so later epochs decode
            as without the check. False: served as decoded. With decode="gpu" only the files
            decoded on the CPU are checked: nvJPEG reports no such damage.
        max_side: the decoded cache stores each whole image, aspect kept, with its longer side
            at most this (FFCV's `max_resolution`); default 2 x the larger side of `size`.
        decode: "cpu" (uint8 crops from the workers), or "gpu": workers only read the file bytes
            and draw the crop and flip (seeded, as on the CPU); `GpuDecode` decodes, crops,
            resizes and normalises whole batches on the device (collate with `encoded_collate`).
        region_decode: decode only the crop of a JPEG (libjpeg-turbo's cropped decode through
            nvImageCodec's CPU backend, `pip install "recipes[roi]"`; same pixels). None: when
            nvImageCodec is installed; True: require it. Crops small enough for a 1/4 or 1/8
            DCT-scaled decode use that instead. A strict first decode of a file reads on to
            the bottom of the image (what region decode saves), later ones only the crop.

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
        from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

        if on_error not in ("raise", "skip"):
            raise ValueError(f"`on_error` must be 'raise' or 'skip', but is {on_error!r} instead.")
        self.root = os.fspath(root)
        self.size = _as_size(size)
        if decode not in ("cpu", "gpu"):
            raise ValueError(f"`decode` must be 'cpu' or 'gpu', but is {decode!r} instead.")
        if decode == "gpu" and (transform is not None or cache_dir is not None):
            raise ValueError("decode='gpu' decodes files on the device: a uint8 `transform` or a decoded cache "
                             "(`cache_dir`) belongs to the CPU path (decode='cpu').")
        if decode == "gpu" and not torch.cuda.is_available():
            raise RuntimeError("decode='gpu' needs CUDA, which is not available here; use the CPU path "
                               "(decode='cpu', the default), which is as fast as this machine's cores allow.")
        self.decode = decode
        if region_decode and not region_decode_available():
            raise ImportError('region_decode=True needs nvImageCodec: pip install "recipes[roi]" '
                              "(nvidia-nvimgcodec-cu12; its CPU decoder needs no GPU).")
        self.region_decode = region_decode
        self.max_side = 2 * max(self.size) if max_side is None else max_side
        if not isinstance(self.max_side, int) or self.max_side < max(self.size):
            raise ValueError(f"`max_side` must be an int of at least the output side {max(self.size)}, but is "
                             f"{max_side!r} instead.")
        self.train = train
        self.transform = transform
        self.on_error = on_error
        self.strict = bool(strict)
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
        self._checked = torch.zeros(len(self._paths), dtype=torch.uint8).share_memory_()  # strict: 1 once checked
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
        if self.decode == "gpu":
            item, target, _ = self._load_or_skip(index, self._encoded_item)
            return item, target
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
            if self.decode == "cpu":
                trim_heap()  # decode buffers fragment the heap; keep worker memory flat across epochs
            return items
        indices = [self._check_index(i) for i in indices]
        labels = self.cache.labels[indices]
        if self.transform is not None:  # the transform may change shapes: separate tensors
            items = [(self._cached_item(i), int(t)) for i, t in zip(indices, labels, strict=True)]
        else:
            out_h, out_w = self.resolution
            batch = new_uint8_batch(len(indices), 3, out_h, out_w)
            for row, index in enumerate(indices):
                copy_image(batch[row], self._cached_item(index))
            items = [(batch[row], int(t)) for row, t in enumerate(labels)]
        trim_heap()
        return items

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A per-process read buffer of at least `nbytes` (never handed out: crops are resized
        out of it)."""
        if getattr(self, "_scratch_pid", None) != os.getpid() or self._scratch_buf.nbytes < nbytes:
            self._scratch_buf = np.empty(max(nbytes, self.max_side * self.max_side * 3), np.uint8)
            self._scratch_pid = os.getpid()
        return self._scratch_buf[:nbytes]

    def _check_index(self, index) -> int:
        return resolve_index(index, len(self), f"the {len(self)} images under {self.root}")

    def _load_or_skip(self, index: int, load):
        """`load(i)` for `index`, or with on_error="skip" the next good index after it.

        A bad file consumes no randomness: the generator is rewound to before its attempt, so
        the replacement draws what the bad file would have drawn. The CPU path finds a
        truncated or undecodable file only after drawing its crop (the decode needs the box),
        decode="gpu" workers before drawing (they check the bytes first); rewound, both give
        every later image the same crop and flip.
        """
        n = len(self)
        rewind = self._generator().bit_generator.state if self.train and self.on_error == "skip" else None
        for step in range(n):
            i = (index + step) % n
            try:
                return (*load(i), step > 0)
            except ImageDecodeError:
                if self.on_error == "raise":
                    raise
                self._bad[i] = 1
                if rewind is not None:
                    self._generator().bit_generator.state = rewind
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

    def _encoded_item(self, index: int) -> tuple[dict, int]:
        """decode="gpu": the file's bytes (checked as far as a header allows), its crop box in
        source pixels and its flip, drawn as the CPU path draws them."""
        path, data, header = self._read(index)
        is_jpeg = check_encoded(data, header, path=path, index=index)
        out = self.resolution
        if self.train:
            box = random_resized_box(header.height, header.width, self._generator(), self.SCALE, self.RATIO)
            flip = bool(self._generator().random() < 0.5)
        else:
            box, flip = eval_box(header.height, header.width, out, self.CROP_PCT), False
        item = {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8), "box": torch.tensor(box, dtype=torch.int64),
                "flip": flip, "jpeg": is_jpeg, "index": index, "size": out}
        return item, int(self._targets[index])

    def _decode_box(self, data, header, box, out, path, index) -> np.ndarray:
        """Decodes only `box` (region decode), or at the coarsest DCT scale that keeps `box` at
        least `out`, then crops it. With `strict`, a file's first decode is checked (a region
        decode then reads on to the image's bottom: the same pixels, the whole scan seen)."""
        reduce = dct_reduction((box[2], box[3]), out)
        check = self.strict and not self._checked[index]
        if reduce <= 2 and self.region_decode is not False and header.format == "JPEG":
            check_encoded(data, header, path=path, index=index)
            region = decode_region(data, box, strict=check, path=path, index=index)
            if region is not None:
                if check:
                    self._checked[index] = 1
                return region
        decoded = decode_image(data, reduce=reduce, header=header, path=path, index=index, strict=check)
        if check:
            self._checked[index] = 1
        h, w = decoded.shape[:2]
        if (h, w) != (header.height, header.width):
            box = scale_box(box, h / header.height, w / header.width, h, w)
        top, left, bh, bw = box
        return decoded[top : top + bh, left : left + bw]

    def _cache_image(self, index: int) -> tuple[np.ndarray, int]:
        """`([h, w, 3] uint8, target)`: the whole image, its longer side at most `max_side`."""
        path, data, header = self._read(index)
        h, w = stored_shape(header.height, header.width, self.max_side)
        decoded = decode_image(data, reduce=dct_reduction((header.height, header.width), (h, w)), header=header,
                               path=path, index=index, strict=self.strict)
        if decoded.shape[:2] != (h, w):
            decoded = resize_uint8(decoded, (h, w)).permute(1, 2, 0).numpy()
        return np.ascontiguousarray(decoded), int(self._targets[index])

    # ---- the decoded cache ------------------------------------------------------------
    def cache_fingerprint(self) -> str:
        """sha256 of the inputs: relative paths, sizes, mtimes, targets, S and decode settings."""
        return self._cache_inputs()[0]

    def _cache_inputs(self) -> tuple[str, list[str], np.ndarray]:
        """`(fingerprint, relative paths, file table)`: one `stat` per file."""
        import hashlib

        import cv2

        digest = hashlib.sha256()
        settings = f"v{FORMAT_VERSION}|max_side={self.max_side}|resize=bilinear-aa|cv2={cv2.__version__}"
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
        """Serves items from `cache`, checked against this dataset's size and targets.

        Raises:
            ImageCacheError: `labels.bin` disagrees with the targets.
        """
        if cache.count != len(self):
            raise ValueError(f"the cache holds {cache.count} images but the dataset has {len(self)}.")
        cache.check_labels(self._targets)
        self.cache = cache
        for i in cache.skipped:
            self._bad[i] = 1

    def _from_cache(self, index: int) -> tuple[torch.Tensor, int]:
        return self._cached_item(index), int(self.cache.labels[index])

    def _cached_item(self, index: int) -> torch.Tensor:
        """The output crop of cached image `index`: only the crop's rows are read."""
        h, w = (int(v) for v in self.cache.shapes[index])
        out = self.resolution
        if self.train:  # relative to the whole image: torchvision's distribution on the original
            top, left, bh, bw = random_resized_box(h, w, self._generator(), self.SCALE, self.RATIO)
        else:
            top, left, bh, bw = eval_box(h, w, out, self.CROP_PCT)
        rows = self.cache.read_rows(index, top, bh, self._scratch(bh * w * 3).reshape(bh, w, 3))
        image = resize_uint8(rows[:, left : left + bw], out)
        if (bh, bw) == tuple(out):  # a view of the scratch buffer, which the next read reuses
            image = image.clone()
        return self._finish(image)

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


def stored_shape(height: int, width: int, max_side: int) -> tuple[int, int]:
    """The cached size of a `height x width` image: aspect kept, longer side at most `max_side`."""
    scale = min(1.0, max_side / max(height, width))
    return max(1, round(height * scale)), max(1, round(width * scale))


class ImageCache:
    """An opened, validated decoded-image cache folder; its files are mapped lazily per process.

    Image `i` is `shapes[i]` = (h, w) pixels, stored as `uint8 [h, w, 3]` at byte `offsets[i]`
    of `images.bin`.
    """

    def __init__(self, path: Path, header: dict, shapes: np.ndarray, offsets: np.ndarray):
        self.path, self.header = Path(path), header
        self.count, self.max_side = int(header["count"]), int(header["max_side"])
        self.fingerprint: str = header["fingerprint"]
        self.skipped: tuple[int, ...] = tuple(header["skipped"])
        self.shapes, self.offsets = shapes, offsets
        # copy-on-write: writable views for torch.from_numpy; the file is never written. A file
        # truncated or replaced after this open raises ImageCacheError in the process that
        # maps it next (a fresh worker), naming it.
        self._labels = LazyMap(self.path / "labels.bin", "<i8", (self.count,), mode="c", error=ImageCacheError)
        self._images = LazyMap(self.path / "images.bin", np.uint8, (int(offsets[-1]),), error=ImageCacheError)

    @staticmethod
    def folder_for(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
        return Path(cache_dir) / f"images-{fingerprint[:24]}"

    @classmethod
    def open(cls, path: str | os.PathLike, *, fingerprint: str | None = None) -> ImageCache:
        """Opens and validates a cache folder (header, file sizes, offsets).

        Raises:
            ImageCacheError: missing, truncated, corrupt, another format version, or (with
                `fingerprint`) built from other inputs; the message says to rebuild.
        """
        path = Path(path)
        header = read_header(path, fmt=FORMAT, version=FORMAT_VERSION, fingerprint=fingerprint,
                             error=ImageCacheError, build_hint=_BUILD_HINT,
                             fields=("fingerprint", "count", "max_side", "skipped"))
        invalid = ImageCacheError(f"{path}/header.json has invalid fields; rebuild it with {_BUILD_HINT}.")
        try:
            count, max_side = int(header["count"]), int(header["max_side"])
            skipped = [int(i) for i in header["skipped"]]
        except (TypeError, ValueError):
            raise invalid from None
        if count < 0 or max_side <= 0 or any(not 0 <= i < count for i in skipped):
            raise invalid
        check_size(path / "labels.bin", 8 * count, ImageCacheError)
        check_size(path / "shapes.bin", 8 * count, ImageCacheError)
        check_size(path / "offsets.bin", 8 * (count + 1), ImageCacheError)
        shapes = np.fromfile(path / "shapes.bin", "<i4").reshape(count, 2)
        offsets = np.fromfile(path / "offsets.bin", "<i8")
        expected = np.concatenate(([0], np.cumsum(shapes[:, 0].astype(np.int64) * shapes[:, 1] * 3)))
        if (shapes < 1).any() or (shapes > max_side).any() or not np.array_equal(offsets, expected):
            raise ImageCacheError(f"{path}/shapes.bin or offsets.bin is corrupt; rebuild it with {_BUILD_HINT}.")
        check_size(path / "images.bin", int(offsets[-1]), ImageCacheError)
        return cls(path, header, shapes, offsets)

    def read(self, index: int) -> np.ndarray:
        """Image `index` as a fresh `uint8 [h, w, 3]` array."""
        h, w = (int(v) for v in self.shapes[index])
        return self.read_rows(index, 0, h, np.empty((h, w, 3), np.uint8))

    def read_rows(self, index: int, top: int, rows: int, out: np.ndarray) -> np.ndarray:
        """Rows `top : top + rows` of image `index` into `out` (`uint8 [rows, w, 3]`,
        C-contiguous) with one `preadv`; returns `out`."""
        w = int(self.shapes[index][1])
        return self._images.read_into(out, int(self.offsets[index]) + top * w * 3)

    def read_padded(self, index: int, out: np.ndarray) -> tuple[int, int]:
        """Image `index` into the top-left corner of `out` (`uint8 [M, M, 3]`, M >= max_side),
        one `preadv` with a buffer per row; returns its `(h, w)`."""
        h, w = (int(v) for v in self.shapes[index])
        self._images.read_into([out[r, :w] for r in range(h)], int(self.offsets[index]))
        return h, w

    @property
    def labels(self) -> np.ndarray:
        """`int64 [N]` memory map."""
        return self._labels.array

    def check_labels(self, targets: np.ndarray) -> None:
        """Checks `labels.bin` against the dataset's `targets` (`int [N]`): image `i` is labelled
        `targets[i]`, or, for a skipped index, the target of the image stored in its place (the
        next index not skipped, wrapping around, as `on_error="skip"` chose it at build).

        Raises:
            ImageCacheError: a label differs (a damaged file); names the first index and says
                to rebuild.
        """
        expected = np.array(targets, dtype=np.int64)
        if self.skipped:
            skipped = np.array(self.skipped, dtype=np.int64)
            kept = np.setdiff1d(np.arange(self.count), skipped)
            if len(kept):
                expected[skipped] = expected[kept[np.searchsorted(kept, skipped) % len(kept)]]
        stored = np.fromfile(self.path / "labels.bin", "<i8", count=self.count)
        if len(stored) != self.count:  # shrank since `open` checked its size
            raise ImageCacheError(f"{self.path}/labels.bin holds {len(stored)} labels, expected {self.count}; "
                                  f"rebuild it with {_BUILD_HINT}.")
        wrong = np.flatnonzero(stored != expected)
        if len(wrong):
            i = int(wrong[0])
            raise ImageCacheError(f"{self.path}/labels.bin labels image {i} {int(stored[i])}, but the dataset's target "
                                  f"for it is {int(expected[i])} ({len(wrong)} of {self.count} labels differ): the "
                                  f"file is damaged. Rebuild it with {_BUILD_HINT}.")

    def __repr__(self) -> str:
        return f"ImageCache({str(self.path)!r}, n={self.count}, max_side={self.max_side})"


def build_image_cache(dataset: ImageFolderFast, cache_dir: str | os.PathLike, *, num_workers: int | None = None,
                      progress: bool = True, distributed: bool = False) -> ImageCache:
    """Decodes every image of an `ImageFolderFast` once into a memory-mapped cache.

    Each whole image is stored with its aspect ratio, its longer side resized to at most the
    dataset's `max_side` (decoded at the coarsest DCT scale that allows it), by parallel
    DataLoader workers with a tqdm bar, into a temp folder renamed into place when complete.
    Train crops from the cache then follow torchvision's `RandomResizedCrop` over the original
    image. An existing valid cache is reused; caches of the same tree built from other inputs
    are removed. The dataset reads the cache from then on.

    Args:
        dataset: an `ImageFolderFast`.
        cache_dir: the folder for caches (created).
        num_workers: decode workers per rank; `smart_num_workers()` when None.
        progress: show a progress bar (on rank 0).
        distributed: split the decoding over the ranks of the initialised process group (every
            rank must make the same call); rank 0 joins the ranks' parts and publishes.
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
    if build.needed(lambda: ImageCache.open(target, fingerprint=fingerprint).check_labels(dataset.targets),
                    ImageCacheError):
        with build:
            shapes, labels, skipped = _decode_part(dataset, build, num_workers, progress and build.rank == 0)
            write_synced(build.part("labels.bin"), labels.astype("<i8").tobytes())
            write_synced(build.part("shapes.bin"), shapes.astype("<i4").tobytes())
            for name in ("images.bin", "labels.bin", "shapes.bin"):
                build.concat(name)
            skipped = sorted(i for part in build.gather(skipped) for i in part)
            if build.rank == 0:
                shapes = np.fromfile(build.path / "shapes.bin", "<i4").reshape(-1, 2).astype(np.int64)
                offsets = np.concatenate(([0], np.cumsum(shapes[:, 0] * shapes[:, 1] * 3)))
                write_synced(build.path / "offsets.bin", offsets.astype("<i8").tobytes())
                with open(build.path / "files.npy", "wb") as f:
                    np.save(f, table, allow_pickle=False)
            build.publish({"format": FORMAT, "version": FORMAT_VERSION, "fingerprint": fingerprint,
                           "count": len(dataset), "max_side": dataset.max_side, "skipped": skipped,
                           "root": os.path.abspath(dataset.root)})
    if build.rank == 0:  # replaced, not left beside it
        for stale in _stale_caches(Path(cache_dir), os.path.abspath(dataset.root), fingerprint):
            _remove_cache(stale)
    cache = ImageCache.open(target, fingerprint=fingerprint)
    dataset._serve(cache)
    return cache


class _CacheItems:
    """Items `(index, [h, w, 3] array, target, skipped)` of `block`, for the cache build."""

    def __init__(self, dataset: ImageFolderFast, block: range):
        self.dataset, self.block = dataset, block

    def __len__(self) -> int:
        return len(self.block)

    def __getitem__(self, position: int):
        index = self.block[position]
        return (index, *self.dataset._load_or_skip(index, self.dataset._cache_image))


def _as_lists(batch):
    return list(zip(*batch, strict=True))


def _decode_part(dataset, build: FolderBuild, num_workers: int | None, progress: bool):
    """This rank's block, decoded in index order into `part("images.bin")`; returns the
    block's `(shapes [n, 2], labels [n], skipped indices)`."""
    from tqdm import tqdm

    block = build.block(len(dataset))
    shapes, labels = np.zeros((len(block), 2), np.int64), np.zeros(len(block), np.int64)
    skipped: list[int] = []
    loader = build_loader(_CacheItems(dataset, block), num_workers=num_workers, batch_size=16, collate_fn=_as_lists)
    with open(build.part("images.bin"), "wb") as out, \
            tqdm(total=len(dataset), disable=not progress, desc="decoding images", unit="img") as bar:
        for indices, arrays, targets, was_skipped in loader:
            for index, array, target, skip in zip(indices, arrays, targets, was_skipped, strict=True):
                out.write(array.tobytes())
                shapes[index - block.start] = array.shape[:2]
                labels[index - block.start] = target
                if skip:
                    skipped.append(index)
            bar.update(len(indices) * build.world)
        out.flush()
        os.fsync(out.fileno())
    return shapes, labels, skipped


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
