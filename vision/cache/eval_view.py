"""Eval views of a decoded image cache: each image as evaluation sees it, so serving is a row copy.

Use when: a validation set is read from a decoded cache at a fixed resolution. The cache stores
whole images for training (crops over the whole image), so an eval item would be resized out
of the stored image every epoch, and its pixels resized twice (once into the store, once out
of it: 1.59 grey levels from torchvision's `Resize(256)` + `CenterCrop(224)`). An eval view
stores, beside the whole images, every image at one eval resolution as torchvision makes it
(`eval_view_build.py` writes it). Serving is one `preadv` of `h * w * 3` bytes, and the pixels
are torchvision's to within a grey level (the file path crops before it resizes, which shifts
the sampling grid by up to half a source pixel).
Cost: `h * w * 3` bytes per image (150 KB at 224 px); opening reads the header and the sums
file and checks them.
Adapt here: nothing; `ImageFolderFast.CROP_PCT` and the size name the view.
Trade-off: one view per resolution: an eval at another resolution (`set_resolution`) reads
the whole images until `build_image_cache` adds that view.

Files, beside the cache's own in `images-<fingerprint[:24]>/`:
  eval-<h>x<w>-crop<pct>.bin    uint8 N x h x w x 3, image i at byte i * h * w * 3
  eval-<h>x<w>-crop<pct>.sums   uint64 x N, image i's checksum
  (`recipes.common.caches.cache_checks`) eval-<h>x<w>-crop<pct>.json   {"format", "version",
  "fingerprint", "count", "size", "crop_pct",
                                 "checksum", "sums_checksum", "header_sha256"}
A view whose header is damaged or names another cache
fingerprint, count or size, or whose data file has another size or sums file another
checksum, is not opened (`eval_view_of` warns, naming it, and the next `build_image_cache`
rebuilds it); an image whose row differs from its checksum raises the cache's error when read
and is recorded in the cache's `damaged.json`: the view is then not opened, and the next
`build_image_cache` on an eval dataset rebuilds the view alone (not the whole images).
Copy with: common/caches/cache_checks.py, common/caches/cache_files.py,
  common/workers/held_descriptors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recipes.common.caches.cache_checks import ItemChecks, VerifyMode, hasher, recorded_damage
from recipes.common.caches.cache_files import LazyMap, _seal

FORMAT = "recipes-image-eval-view"
FORMAT_VERSION = 2  # 2: per-image checksums, a header checksum


def view_name(size: tuple[int, int], crop_pct: float) -> str:
    return f"eval-{size[0]}x{size[1]}-crop{crop_pct:g}"


class EvalView:
    """An opened eval view: `read_into(out, i)` fills `out` (uint8 `[h, w, 3]`, C-contiguous)
    with image `i` in one `preadv`, checked by `checks` (`checks.verify` says when)."""

    def __init__(
        self,
        folder: Path,
        name: str,
        size: tuple[int, int],
        count: int,
        error: type[Exception],
        checks: ItemChecks,
    ):
        self.path = folder / f"{name}.bin"
        self.size = size
        self.count = count
        self.checks = checks
        self._rows = LazyMap(
            self.path, np.uint8, (count, size[0], size[1], 3), mode="c", error=error
        )

    def read_into(self, out: np.ndarray, index: int) -> np.ndarray:
        """Raises: the cache's error: the row differs from its checksum (a damaged view)."""
        self._rows.read_into(out, index * self.size[0] * self.size[1] * 3)
        if self.checks.needed(index):
            rows = out  # a list of row buffers (device_crop.py), or one array
            if not isinstance(out, list):
                rows = [out]
            self.checks.check(index, *rows)
        return out

    def __repr__(self) -> str:
        return f"EvalView({str(self.path)!r}, n={self.count}, size={self.size})"


def open_eval_view(
    folder: Path,
    fingerprint: str,
    count: int,
    size: tuple[int, int],
    crop_pct: float,
    error: type[Exception],
    verify: VerifyMode = "first_read",
) -> EvalView | None:
    """The view of `size` in the cache `folder`, or None when there is none that matches
    (`find_eval_view` says why)."""
    return find_eval_view(folder, fingerprint, count, size, crop_pct, error, verify)[0]


def find_eval_view(
    folder: Path,
    fingerprint: str,
    count: int,
    size: tuple[int, int],
    crop_pct: float,
    error: type[Exception],
    verify: VerifyMode = "first_read",
) -> tuple[EvalView | None, str]:
    """`(view, "")`, or `(None, why)`: none, damaged (its header or sums file), for another
    cache, count or size, an older format, or a data file of another size."""
    name = view_name(size, crop_pct)
    try:
        header = json.loads((folder / f"{name}.json").read_bytes())
    except FileNotFoundError:
        return None, f"there is no {name}.json"
    except (OSError, ValueError) as why:
        return None, f"{name}.json is damaged ({why})"
    seal = None
    if isinstance(header, dict):
        seal = header.pop("header_sha256", None)
    if not isinstance(header, dict) or (
        seal != _seal(header) and (seal or header.get("version") == FORMAT_VERSION)
    ):
        return None, f"{name}.json is damaged (its checksum differs from its content)"
    if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
        return (
            None,
            f"{name}.json is of an older format (v{header.get('version')}, expected "
            f"v{FORMAT_VERSION})",
        )
    if (header.get("fingerprint"), header.get("count"), tuple(header.get("size", ()))) != (
        fingerprint,
        count,
        tuple(size),
    ):
        return None, f"{name}.json was built for another cache, count or size"
    try:
        if (folder / f"{name}.bin").stat().st_size != count * size[0] * size[1] * 3:
            return None, f"{name}.bin is truncated or of another size"
        sums = (folder / f"{name}.sums").read_bytes()
        if (
            f"{hasher(header['checksum'], error)(sums):016x}" != header.get("sums_checksum")
            or len(sums) != 8 * count
        ):
            return None, f"{name}.sums is damaged (its checksum differs from the header's)"
    except (OSError, KeyError, error) as why:
        return None, f"{name} is incomplete or unreadable ({why})"
    damage = recorded_damage(
        folder, (f"{name}.bin",)
    )  # a read or `recipes cache verify` found damage
    if damage is not None:
        return None, f"damaged: {damage}"
    checks = ItemChecks(
        folder / f"{name}.bin",
        np.frombuffer(sums, "<u8"),
        header["checksum"],
        verify=verify,
        error=error,
        hint="build_image_cache() on an eval dataset of this size",
        label="image",
    )
    return EvalView(folder, name, tuple(size), count, error, checks), ""
