"""ImageCache: an opened decoded-image cache, every image of a dataset decoded once into one
memory-mapped file.

Use when: the CPU cannot decode fast enough and the decoded images fit on local disk. The
decoded cache (`build_image_cache`): every image decoded once and stored whole, its aspect
kept and its longer side at most `max_side` (FFCV's `max_resolution`; default 2 x size), in one
uint8 file of variable-size records. Train crops are drawn over the whole stored image, so they
follow torchvision's `RandomResizedCrop` on the original (scale and ratio relative to its area
and aspect) and reach its borders; eval crops come from the same record.
Cost: one decode per image at build (DataLoader workers, split over the ranks with
`distributed=True`); then per item a crop from a memory map: only a crop's rows are read, but
an image is read whole and hashed at its first read in a process (its check, below).
Adapt here: `max_side` (an `ImageFolderFast` argument); `image_cache_build.decode_stored` for
how an image is stored (change `FORMAT_VERSION` with it).
Trade-off: about `max_side^2 * 3 * 0.75` bytes per 4:3 image (450 KB at 448: local NVMe).
Layout of `cache_dir/images-<fingerprint[:24]>/` (the `recipes.common.caches.cache_files` protocol):
  header.json   {"format": "recipes-image-cache", "version", "fingerprint", "count", "max_side",
                 "skipped", "root", "checksum", "file_checksums", "header_sha256"}
  labels.bin    int64 x N
  shapes.bin    int32 x N x 2 (h, w of each stored image)
  offsets.bin   int64 x (N + 1): image i is bytes offsets[i]:offsets[i + 1], [h, w, 3] uint8
  images.bin    the images back to back
  checksums.bin uint64 x N: image i's checksum (`recipes.common.caches.cache_checks`)
  files.npy     per input file: path hash, size, mtime (names what changed in a stale cache)
The fingerprint covers the relative paths, sizes, mtimes, targets, `max_side` and decode
settings; a cache built from other inputs is never served: a warning names the changed files.
A damaged file is not served either: the header holds its own checksum and one per small file
(checked on open), and each image is checked against `checksums.bin` when read (`verify=`,
`ImageCache.checks`); an image found damaged is recorded in `damaged.json`, and the folder then
fails to open, so `build_image_cache` rebuilds it (`recipes.vision.cache.image_cache_build`).
Copy with: common/caches/cache_checks.py, common/caches/cache_files.py,
  common/workers/held_descriptors.py, vision/decoding/decode.py, vision/decoding/image_header.py,
  vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from recipes.common.caches.cache_checks import ItemChecks, VerifyMode, check_damage, read_checked
from recipes.common.caches.cache_files import LazyMap, check_size, read_header
from recipes.vision.decoding.decode import resize_uint8

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

    def __init__(
        self,
        path: Path,
        header: dict,
        shapes: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray,
        sums: np.ndarray,
        verify: VerifyMode = "first_read",
    ):
        self.path = Path(path)
        self.header = header
        self.count = int(header["count"])
        self.max_side = int(header["max_side"])
        self.fingerprint: str = header["fingerprint"]
        self.skipped: tuple[int, ...] = tuple(header["skipped"])
        self.shapes = shapes
        self.offsets = offsets
        self.labels = labels  # `int64 [N]`, checked against its checksum on open
        # images.bin truncated or replaced after this open: ImageCacheError where it is mapped next
        self._images = LazyMap(
            self.path / "images.bin", np.uint8, (int(offsets[-1]),), error=ImageCacheError
        )
        self.checks = ItemChecks(
            self.path / "images.bin",
            sums,
            header["checksum"],
            verify=verify,
            error=ImageCacheError,
            hint=_BUILD_HINT,
            label="image",
        )

    @staticmethod
    def folder_for(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
        return Path(cache_dir) / f"images-{fingerprint[:24]}"

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        fingerprint: str | None = None,
        verify: VerifyMode = "first_read",
    ) -> ImageCache:
        """Opens and validates a cache folder (header, file sizes and checksums, offsets);
        `verify` says when an image is checked as it is read (`ImageCache.checks`).

        Raises:
            ImageCacheError: missing, truncated, damaged (`damaged.json` names images.bin),
                another format version, or (with `fingerprint`) other inputs; says to rebuild.
        """
        path = Path(path)
        header = read_header(
            path,
            fmt=FORMAT,
            version=FORMAT_VERSION,
            fingerprint=fingerprint,
            error=ImageCacheError,
            build_hint=_BUILD_HINT,
            fields=("fingerprint", "count", "max_side", "skipped", "checksum", "file_checksums"),
        )
        invalid = ImageCacheError(
            f"{path}/header.json has invalid fields; rebuild it with {_BUILD_HINT}."
        )
        try:
            count = int(header["count"])
            max_side = int(header["max_side"])
            skipped = [int(i) for i in header["skipped"]]
        except (TypeError, ValueError):
            raise invalid from None
        if count < 0 or max_side <= 0 or any(not 0 <= i < count for i in skipped):
            raise invalid
        check_size(path / "labels.bin", 8 * count, ImageCacheError)
        check_size(path / "shapes.bin", 8 * count, ImageCacheError)
        check_size(path / "offsets.bin", 8 * (count + 1), ImageCacheError)
        check_size(path / "checksums.bin", 8 * count, ImageCacheError)
        read = functools.partial(
            read_checked, path, header=header, error=ImageCacheError, hint=_BUILD_HINT
        )
        shapes = read("shapes.bin", "<i4").reshape(count, 2)
        offsets = read("offsets.bin", "<i8")
        sums = read("checksums.bin", "<u8")
        labels = read("labels.bin", "<i8")
        _ = read("files.npy", np.uint8)
        expected = np.concatenate(
            ([0], np.cumsum(shapes[:, 0].astype(np.int64) * shapes[:, 1] * 3))
        )
        if (shapes < 1).any() or (shapes > max_side).any() or not np.array_equal(offsets, expected):
            raise ImageCacheError(
                f"{path}/shapes.bin or offsets.bin is corrupt; rebuild it with {_BUILD_HINT}."
            )
        check_size(path / "images.bin", int(offsets[-1]), ImageCacheError)
        check_damage(
            path, ("images.bin",), ImageCacheError, _BUILD_HINT
        )  # a read found damage (not a view's)
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

    def read_crop(
        self,
        index: int,
        box: tuple[int, int, int, int],
        size: tuple[int, int],
        *,
        scratch: np.ndarray | None = None,
        out: torch.Tensor | None = None,
        mirror: bool = False,
    ) -> torch.Tensor:
        """The `box` (top, left, height, width) of image `index` resized to `size` (`resize_uint8`,
        flipped left to right with `mirror`): uint8 `[3, h, w]`, channels-last in memory, written
        into `out` when given (a batch row).
        Only the box's rows are read, with one `preadv` into `scratch` (uint8, at least
        `max_side^2 * 3` bytes: one per reader thread), else a per-process scratch buffer (one
        reader thread at a time)."""
        top, left, bh, bw = box
        h, w = (int(v) for v in self.shapes[index])
        first, count = (
            (0, h) if self.checks.needed(index) else (top, bh)
        )  # an image to check is read whole
        buffer = self._scratch(count * w * 3) if scratch is None else scratch[: count * w * 3]
        rows = self.read_rows(index, first, count, buffer.reshape(count, w, 3))[
            top - first : top - first + bh
        ]
        crop = rows[:, left : left + bw]
        if bw != w and (bh, bw) != tuple(
            size
        ):  # torch's kernel is ~6% faster on contiguous rows than the copy costs
            crop = np.ascontiguousarray(crop)
        image = resize_uint8(crop, size, out=out, mirror=mirror)
        if (
            out is None and not mirror and (bh, bw) == tuple(size)
        ):  # a view of the scratch buffer, reused next read
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
            raise ImageCacheError(
                f"{self.path}/labels.bin labels image {i} {int(stored[i])}, but the dataset's "
                f"target for it is {int(expected[i])} ({len(wrong)} of {self.count} labels "
                f"differ): the file is damaged. Rebuild it with {_BUILD_HINT}."
            )

    def __getstate__(self):
        return {**self.__dict__, "_scratch_buf": None, "_scratch_pid": None}

    def __repr__(self) -> str:
        return f"ImageCache({str(self.path)!r}, n={self.count}, max_side={self.max_side})"
