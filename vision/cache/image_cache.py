"""ImageCache: every image of an `ImageFolderFast` decoded once, into one memory-mapped file.

Use when: the CPU cannot decode fast enough and the decoded images fit on local disk. The
decoded cache (`build_image_cache`): every image decoded once and stored whole, its aspect
kept and its longer side at most `max_side` (FFCV's `max_resolution`; default 2 x size), in one
uint8 file of variable-size records. Train crops are drawn over the whole stored image, so they
follow torchvision's `RandomResizedCrop` on the original (scale and ratio relative to its area
and aspect) and reach its borders; eval crops come from the same record.
Cost: one decode per image at build (DataLoader workers, split over the ranks with
`distributed=True`); then per item a crop from a memory map: only a crop's rows are read, but
an image is read whole and hashed at its first read in a process (its check, below).
Adapt here: `max_side` (an `ImageFolderFast` argument); `decode_stored` for how an image is
stored (change `FORMAT_VERSION` with it).
Trade-off: about `max_side^2 * 3 * 0.75` bytes per 4:3 image (450 KB at 448: local NVMe).
Layout of `cache_dir/images-<fingerprint[:24]>/` (the `recipes.common.cache_files` protocol):
  header.json   {"format": "recipes-image-cache", "version", "fingerprint", "count", "max_side",
                 "skipped", "root", "checksum", "file_checksums", "header_sha256"}
  labels.bin    int64 x N
  shapes.bin    int32 x N x 2 (h, w of each stored image)
  offsets.bin   int64 x (N + 1): image i is bytes offsets[i]:offsets[i + 1], [h, w, 3] uint8
  images.bin    the images back to back
  checksums.bin uint64 x N: image i's checksum (`recipes.common.cache_checks`)
  files.npy     per input file: path hash, size, mtime (names what changed in a stale cache)
The fingerprint covers the relative paths, sizes, mtimes, targets, `max_side` and decode
settings; a cache built from other inputs is never served: a warning names the changed files.
A damaged file is not served either: the header holds its own checksum and one per small file
(checked on open), and each image is checked against `checksums.bin` when read (`verify=`,
`ImageCache.checks`); an image found damaged is recorded in `damaged.json`, and the folder then
fails to open, so `build_image_cache` rebuilds it. The build reads the dataset through its public
side: `paths`, `targets`, `root`, `max_side`, `len()`, `cache_record(i)` and `use_cache(cache)`.
Copy with: common/cache_checks.py, common/cache_files.py, common/held_descriptors.py,
  common/process_lifetime.py, vision/crop.py, vision/decode.py, vision/eval_view.py,
  vision/stale_caches.py.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from recipes.common.cache_checks import (
    ItemChecks,
    VerifyMode,
    algorithm,
    check_damage,
    file_checksums,
    hasher,
    read_checked,
)
from recipes.common.cache_files import (
    FolderBuild,
    LazyMap,
    build_loader,
    check_size,
    read_header,
    sweep_dead_temps,
    write_synced,
)
from recipes.vision.decode import ImageHeader, dct_reduction, decode_image, resize_uint8
from recipes.vision.eval_view import ensure_eval_view
from recipes.vision.stale_caches import describe_change, find_stale_caches, remove_cache, stat_files

if TYPE_CHECKING:
    from recipes.vision.image_folder import ImageFolderFast

FORMAT = "recipes-image-cache"
FORMAT_VERSION = 4  # 4: per-image checksums, a header checksum
_BUILD_HINT = "build_image_cache() or `recipes cache vision`"


class ImageCacheError(ValueError):
    """A decoded-image cache that is missing, truncated, corrupt or built from other inputs."""


def stored_shape(height: int, width: int, max_side: int) -> tuple[int, int]:
    """The cached size of a `height x width` image: aspect kept, longer side at most `max_side`."""
    scale = min(1.0, max_side / max(height, width))
    return max(1, round(height * scale)), max(1, round(width * scale))


class ImageCache:
    """An opened, validated decoded-image cache folder; its files are mapped lazily per process.

    Image `i` is `shapes[i]` = (h, w) pixels, stored as `uint8 [h, w, 3]` at byte `offsets[i]`
    of `images.bin`; `checks` verifies it when read (`checks.verify` sets when).
    """

    def __init__(self, path: Path, header: dict, shapes: np.ndarray, offsets: np.ndarray, labels: np.ndarray,
                 sums: np.ndarray, verify: VerifyMode = "first_read"):
        self.path, self.header = Path(path), header
        self.count, self.max_side = int(header["count"]), int(header["max_side"])
        self.fingerprint: str = header["fingerprint"]
        self.skipped: tuple[int, ...] = tuple(header["skipped"])
        self.shapes, self.offsets = shapes, offsets
        self.labels = labels  # `int64 [N]`, checked against its checksum on open
        # images.bin truncated or replaced after this open: ImageCacheError where it is mapped next
        self._images = LazyMap(self.path / "images.bin", np.uint8, (int(offsets[-1]),), error=ImageCacheError)
        self.checks = ItemChecks(self.path / "images.bin", sums, header["checksum"], verify=verify,
                                 error=ImageCacheError, hint=_BUILD_HINT, label="image")

    @staticmethod
    def folder_for(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
        return Path(cache_dir) / f"images-{fingerprint[:24]}"

    @classmethod
    def open(cls, path: str | os.PathLike, *, fingerprint: str | None = None,
             verify: VerifyMode = "first_read") -> ImageCache:
        """Opens and validates a cache folder (header, file sizes and checksums, offsets);
        `verify` says when an image is checked as it is read (`ImageCache.checks`).

        Raises:
            ImageCacheError: missing, truncated, damaged (`damaged.json` names images.bin),
                another format version, or (with `fingerprint`) other inputs; says to rebuild.
        """
        path = Path(path)
        header = read_header(path, fmt=FORMAT, version=FORMAT_VERSION, fingerprint=fingerprint,
                             error=ImageCacheError, build_hint=_BUILD_HINT,
                             fields=("fingerprint", "count", "max_side", "skipped", "checksum", "file_checksums"))
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
        check_size(path / "checksums.bin", 8 * count, ImageCacheError)
        read = functools.partial(read_checked, path, header=header, error=ImageCacheError, hint=_BUILD_HINT)
        shapes, offsets = read("shapes.bin", "<i4").reshape(count, 2), read("offsets.bin", "<i8")
        sums, labels, _ = read("checksums.bin", "<u8"), read("labels.bin", "<i8"), read("files.npy", np.uint8)
        expected = np.concatenate(([0], np.cumsum(shapes[:, 0].astype(np.int64) * shapes[:, 1] * 3)))
        if (shapes < 1).any() or (shapes > max_side).any() or not np.array_equal(offsets, expected):
            raise ImageCacheError(f"{path}/shapes.bin or offsets.bin is corrupt; rebuild it with {_BUILD_HINT}.")
        check_size(path / "images.bin", int(offsets[-1]), ImageCacheError)
        check_damage(path, ("images.bin",), ImageCacheError, _BUILD_HINT)  # a read found damage (not a view's)
        return cls(path, header, shapes, offsets, labels, sums, verify)

    def read(self, index: int) -> np.ndarray:
        """Image `index` as a fresh `uint8 [h, w, 3]` array."""
        h, w = (int(v) for v in self.shapes[index])
        return self.read_rows(index, 0, h, np.empty((h, w, 3), np.uint8))

    def read_rows(self, index: int, top: int, rows: int, out: np.ndarray) -> np.ndarray:
        """Rows `top : top + rows` of image `index` into `out` (`uint8 [rows, w, 3]`,
        C-contiguous) with one `preadv`; returns `out`. An image `checks` must verify now is
        read whole and checked first.

        Raises:
            ImageCacheError: its bytes differ from its checksum (`images.bin` is damaged)."""
        h, w = (int(v) for v in self.shapes[index])
        if not self.checks.needed(index):
            return self._images.read_into(out, int(self.offsets[index]) + top * w * 3)
        whole = out if (top, rows) == (0, h) else np.empty((h, w, 3), np.uint8)
        self.checks.check(index, self._images.read_into(whole, int(self.offsets[index])))
        if whole is not out:
            out[...] = whole[top : top + rows]
        return out

    def read_padded(self, index: int, out: np.ndarray) -> tuple[int, int]:
        """Image `index` into the top-left corner of `out` (`uint8 [M, M, 3]`, M >= max_side),
        one `preadv` with a buffer per row; returns its `(h, w)`."""
        h, w = (int(v) for v in self.shapes[index])
        rows = self._images.read_into([out[r, :w] for r in range(h)], int(self.offsets[index]))
        if self.checks.needed(index):
            self.checks.check(index, *rows)
        return h, w

    def read_crop(self, index: int, box: tuple[int, int, int, int], size: tuple[int, int], *,
                  scratch: np.ndarray | None = None, out: torch.Tensor | None = None,
                  mirror: bool = False) -> torch.Tensor:
        """The `box` (top, left, height, width) of image `index` resized to `size` (`resize_uint8`,
        flipped left to right with `mirror`): uint8 `[3, h, w]`, channels-last in memory, written
        into `out` when given (a batch row).
        Only the box's rows are read, with one `preadv` into `scratch` (uint8, at least
        `max_side^2 * 3` bytes: one per reader thread), else a per-process scratch buffer (one
        reader thread at a time)."""
        top, left, bh, bw = box
        h, w = (int(v) for v in self.shapes[index])
        first, count = (0, h) if self.checks.needed(index) else (top, bh)  # an image to check is read whole
        buffer = self._scratch(count * w * 3) if scratch is None else scratch[: count * w * 3]
        rows = self.read_rows(index, first, count, buffer.reshape(count, w, 3))[top - first : top - first + bh]
        crop = rows[:, left : left + bw]
        if bw != w and (bh, bw) != tuple(size):  # torch's kernel is ~6% faster on contiguous rows than the copy costs
            crop = np.ascontiguousarray(crop)
        image = resize_uint8(crop, size, out=out, mirror=mirror)
        if out is None and not mirror and (bh, bw) == tuple(size):  # a view of the scratch buffer, reused next read
            image = image.permute(1, 2, 0).clone().permute(2, 0, 1)
        return image

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A per-process read buffer of at least `nbytes` (never handed out: crops are resized
        out of it)."""
        if getattr(self, "_scratch_pid", None) != os.getpid() or self._scratch_buf.nbytes < nbytes:
            self._scratch_buf = np.empty(max(nbytes, self.max_side * self.max_side * 3), np.uint8)
            self._scratch_pid = os.getpid()
        return self._scratch_buf[:nbytes]

    def check_labels(self, targets: np.ndarray) -> None:
        """Checks `labels.bin` against the dataset's `targets` (`int [N]`): image `i` is labelled
        `targets[i]`, or, for a skipped index, the target of the image stored in its place (the
        next index not skipped, wrapping around, as `on_error="skip"` chose it at build).

        Raises:
            ImageCacheError: a label differs; names the first index and says to rebuild.
        """
        expected = np.array(targets, dtype=np.int64)
        if self.skipped:
            skipped = np.array(self.skipped, dtype=np.int64)
            kept = np.setdiff1d(np.arange(self.count), skipped)
            if len(kept):
                expected[skipped] = expected[kept[np.searchsorted(kept, skipped) % len(kept)]]
        stored = self.labels
        wrong = np.flatnonzero(stored != expected)
        if len(wrong):
            i = int(wrong[0])
            raise ImageCacheError(f"{self.path}/labels.bin labels image {i} {int(stored[i])}, but the dataset's target "
                                  f"for it is {int(expected[i])} ({len(wrong)} of {self.count} labels differ): the "
                                  f"file is damaged. Rebuild it with {_BUILD_HINT}.")

    def __getstate__(self):
        return {**self.__dict__, "_scratch_buf": None, "_scratch_pid": None}

    def __repr__(self) -> str:
        return f"ImageCache({str(self.path)!r}, n={self.count}, max_side={self.max_side})"


def cache_inputs(paths, targets: np.ndarray, root: str, max_side: int) -> tuple[str, list[str], np.ndarray]:
    """`(fingerprint, relative paths, file table)` of a dataset's files (`stale_caches.stat_files`),
    under this format's version and decode settings (`max_side`, the resize, OpenCV's version)."""
    import cv2

    return stat_files(paths, targets, root, f"v{FORMAT_VERSION}|max_side={max_side}|resize=bilinear-aa|cv2={cv2.__version__}")


def decode_stored(data: bytes, header: ImageHeader, max_side: int, *, strict: bool, path: str,
                  index: int) -> np.ndarray:
    """An image as the cache stores it: `uint8 [h, w, 3]`, C-contiguous, the whole image with
    its longer side at most `max_side`, decoded at the coarsest DCT scale that allows it.

    Raises:
        ImageDecodeError: a bad file (see `decode_image`).
    """
    h, w = stored_shape(header.height, header.width, max_side)
    decoded = decode_image(data, reduce=dct_reduction((header.height, header.width), (h, w)), header=header,
                           path=path, index=index, strict=strict)
    if decoded.shape[:2] != (h, w):
        decoded = resize_uint8(decoded, (h, w)).permute(1, 2, 0).numpy()
    return np.ascontiguousarray(decoded)


def attach_image_cache(cache_dir: Path, root: str, paths, targets: np.ndarray, max_side: int, *,
                       use_cache: Callable[[ImageCache], None]) -> None:
    """Opens the cache in `cache_dir` built from exactly these inputs and hands it to `use_cache`
    (a dataset's). Without one, or with one that is damaged or that `use_cache` refuses
    (`ImageCacheError`), it warns and hands over nothing: the dataset decodes from files. The
    warning names what changed when a cache of the same `root` was built from other inputs. A
    temp folder (or eval-view temp file) left by a build killed midway is removed.
    """
    fingerprint, rels, table = cache_inputs(paths, targets, root, max_side)
    path = ImageCache.folder_for(cache_dir, fingerprint)
    if cache_dir.is_dir():
        sweep_dead_temps(cache_dir, path.name)  # a build killed midway leaves its temp folder
    if not path.exists():
        stale = find_stale_caches(cache_dir, os.path.abspath(root), fingerprint) if cache_dir.is_dir() else []
        if stale:
            warnings.warn(f"Not using the image cache in {cache_dir}: it was built from other inputs "
                          f"({describe_change(stale[-1], rels, table)}). Decoding from files, about 10x slower; "
                          "rebuild with build_image_cache() or `recipes cache vision`, which replaces it.",
                          stacklevel=3)  # the caller of ImageFolderFast(...)
        return
    sweep_dead_temps(path, "eval-*")  # an eval-view build killed midway leaves its temp files in the cache
    try:
        use_cache(ImageCache.open(path, fingerprint=fingerprint))
    except ImageCacheError as why:
        warnings.warn(f"Not using the image cache: {why} Decoding from files.", stacklevel=3)


def build_image_cache(dataset: ImageFolderFast, cache_dir: str | os.PathLike, *, num_workers: int | None = None,
                      progress: bool = True, distributed: bool = False) -> ImageCache:
    """Decodes every image of an `ImageFolderFast` once into a memory-mapped cache.

    Each whole image is stored with its aspect ratio, its longer side at most the dataset's
    `max_side` (decoded at the coarsest DCT scale that allows it), by DataLoader workers with a
    tqdm bar, into a temp folder renamed into place when complete. Train crops from the cache
    follow torchvision's `RandomResizedCrop` over the original image. For an eval dataset
    (`train=False`) it also stores the eval view of its resolution (`recipes.vision.eval_view`):
    each image as torchvision's `Resize + CenterCrop` makes it from a full decode, to within a
    grey level; eval items are then row copies. These are not the uncached file path's pixels,
    which crops before it resizes (a mean ~2 grey levels apart, more at edges and on upscaled
    small images). A valid cache (and view) is reused; one recorded damaged (`damaged.json`) is
    rebuilt; caches of the same tree from other inputs are removed. The dataset then reads it.

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
        TypeError: `dataset` is not an `ImageFolderFast` (a `ShardSet`, a path: see the message).
    """
    if not hasattr(dataset, "cache_record"):  # issue 27: the cache is that dataset's, read back by it
        raise TypeError(f"`dataset` must be an ImageFolderFast, but is {type(dataset).__name__} instead: the cache "
                        "is read back by that dataset, by index, its labels checked against the dataset's targets. "
                        "Image shards: decode per sample with ShardSet.dataset(transform=ShardImages(...)), or "
                        "write their images to root/<class>/<key>.jpg and cache ImageFolderFast(root).")
    fingerprint, _, table = cache_inputs(dataset.paths, dataset.targets, dataset.root, dataset.max_side)
    target = ImageCache.folder_for(cache_dir, fingerprint)
    build = FolderBuild(target, distributed=distributed)
    if build.needed(lambda: ImageCache.open(target, fingerprint=fingerprint).check_labels(dataset.targets),
                    ImageCacheError):
        with build:
            checksum = build.gather(algorithm())[0]  # rank 0's, on every rank
            shapes, labels, skipped, sums = _decode_part(dataset, build, num_workers, progress and build.rank == 0,
                                                         hasher(checksum))
            write_synced(build.part("labels.bin"), labels.astype("<i8").tobytes())
            write_synced(build.part("shapes.bin"), shapes.astype("<i4").tobytes())
            write_synced(build.part("checksums.bin"), sums.tobytes())
            for name in ("images.bin", "labels.bin", "shapes.bin", "checksums.bin"):
                build.concat(name)
            skipped = sorted(i for part in build.gather(skipped) for i in part)
            if build.rank == 0:
                shapes = np.fromfile(build.path / "shapes.bin", "<i4").reshape(-1, 2).astype(np.int64)
                offsets = np.concatenate(([0], np.cumsum(shapes[:, 0] * shapes[:, 1] * 3)))
                write_synced(build.path / "offsets.bin", offsets.astype("<i8").tobytes())
                with open(build.path / "files.npy", "wb") as f:
                    np.save(f, table, allow_pickle=False)
                table = file_checksums(build.path, ("labels.bin", "shapes.bin", "offsets.bin", "checksums.bin",
                                                    "files.npy"), checksum)
            build.publish({"format": FORMAT, "version": FORMAT_VERSION, "fingerprint": fingerprint,
                           "count": len(dataset), "max_side": dataset.max_side, "skipped": skipped,
                           "root": os.path.abspath(dataset.root), "checksum": checksum, "file_checksums": table})
    if build.rank == 0:  # replaced, not left beside it
        for stale in find_stale_caches(Path(cache_dir), os.path.abspath(dataset.root), fingerprint):
            remove_cache(stale)
    cache = ImageCache.open(target, fingerprint=fingerprint)
    dataset.use_cache(cache)
    if not dataset.train:  # evaluation at this resolution serves rows of an eval view
        ensure_eval_view(dataset, cache, builder=build.rank == 0, distributed=distributed, num_workers=num_workers,
                         progress=progress, error=ImageCacheError)
    return cache


class _CacheItems:
    """Items `(index, [h, w, 3] array, target, skipped)` of `block`, for the cache build."""

    def __init__(self, dataset: ImageFolderFast, block: range):
        self.dataset, self.block = dataset, block

    def __len__(self) -> int:
        return len(self.block)

    def __getitem__(self, position: int):
        index = self.block[position]
        return (index, *self.dataset.cache_record(index))


def _decode_part(dataset, build: FolderBuild, num_workers: int | None, progress: bool, hash_):
    """This rank's block, decoded in index order into `part("images.bin")`; returns the
    block's `(shapes [n, 2], labels [n], skipped indices, checksums [n])`."""
    from tqdm import tqdm

    block = build.block(len(dataset))
    shapes, labels = np.zeros((len(block), 2), np.int64), np.zeros(len(block), np.int64)
    sums = np.zeros(len(block), "<u8")
    skipped: list[int] = []
    loader = build_loader(_CacheItems(dataset, block), num_workers=num_workers, batch_size=16, collate_fn=list)
    with open(build.part("images.bin"), "wb") as out, \
            tqdm(total=len(dataset), disable=not progress, desc="decoding images", unit="img") as bar:
        for batch in loader:  # items (index, image, target, skipped) in index order
            for index, array, target, skip in batch:
                out.write(array.tobytes())
                sums[index - block.start] = hash_(array)  # of the bytes written
                shapes[index - block.start] = array.shape[:2]
                labels[index - block.start] = target
                if skip:
                    skipped.append(index)
            bar.update(len(batch) * build.world)
        out.flush()
        os.fsync(out.fileno())
    return shapes, labels, skipped, sums
