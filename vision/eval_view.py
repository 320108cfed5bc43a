"""Eval views of a decoded image cache: each image as evaluation sees it, so serving is a row copy.

Use when: a validation set is read from a decoded cache at a fixed resolution. The cache stores
whole images for training (crops over the whole image), so an eval item would be resized out
of the stored image every epoch, and its pixels resized twice (once into the store, once out
of it: 1.59 grey levels from torchvision's `Resize(256)` + `CenterCrop(224)`). An eval view
stores, beside the whole images, every image at one eval resolution as torchvision makes it:
a full decode, the whole image resized (antialiased bilinear, Pillow's filter) to
`Resize(resize)`'s size, then `CenterCrop(size)`'s region. Serving is one `preadv` of
`h * w * 3` bytes, and the pixels are torchvision's to within a grey level (the file path
crops before it resizes, which shifts the sampling grid by up to half a source pixel).
Cost: one more decode per image when built (`build_image_cache` on an eval dataset builds the
view of its resolution); `h * w * 3` bytes per image (150 KB at 224 px).
Adapt here: nothing; `ImageFolderFast.CROP_PCT` and the size name the view.
Trade-off: one view per resolution: an eval at another resolution (`set_resolution`) reads
the whole images until `build_image_cache` adds that view.

Files, beside the cache's own in `images-<fingerprint[:24]>/`:
  eval-<h>x<w>-crop<pct>.bin    uint8 N x h x w x 3, image i at byte i * h * w * 3
  eval-<h>x<w>-crop<pct>.json   {"format", "version", "fingerprint", "count", "size", "crop_pct"}
The `.bin` and `.json` are written to temp files (`.<name>.<host>.<pid>.{data,json}.tmp`,
swept when their builder on this host is dead) and fsynced; under the cache folder's lock,
unless a valid view appeared meanwhile, the `.bin` is renamed into place first and the `.json`,
renamed last, commits it. A view whose header names another cache fingerprint, count or size,
or whose data file has another size, is not served (and is rebuilt by the next
`build_image_cache`).
Copy with: common/cache_files.py, common/held_descriptors.py, common/process_lifetime.py,
  vision/crop.py, vision/decode.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from recipes.common.cache_files import (
    LazyMap,
    _host,
    build_loader,
    folder_lock,
    fsync_path,
    sweep_dead_temps,
    write_synced,
)
from recipes.vision.crop import _resized, resize_side
from recipes.vision.decode import decode_image, resize_uint8

FORMAT = "recipes-image-eval-view"
FORMAT_VERSION = 1


def eval_image(decoded: np.ndarray, size: tuple[int, int], crop_pct: float):
    """torchvision's `Resize(resize_side(size)) + CenterCrop(size)` of a decoded `[H, W, 3]`
    uint8 image: uint8 `[3, h, w]`, channels-last in memory."""
    new_h, new_w = _resized(decoded.shape[0], decoded.shape[1], resize_side(size, crop_pct))
    resized = resize_uint8(decoded, (new_h, new_w))
    top, left = int(round((new_h - size[0]) / 2.0)), int(round((new_w - size[1]) / 2.0))
    return resized[:, top : top + size[0], left : left + size[1]]


def eval_record(dataset, index: int):
    """`ImageFolderFast.eval_record`: what an eval view stores at `index` (`eval_image` of a
    full decode of its file; with on_error="skip", of the next good file's)."""
    if dataset.train:
        raise ValueError("eval_record is what evaluation sees, but this dataset has train=True.")

    def load(i: int):
        path, data, header = dataset._read(i)
        decoded = decode_image(data, reduce=1, header=header, path=path, index=i, strict=dataset.strict)
        return eval_image(decoded, dataset.resolution, dataset.CROP_PCT), int(dataset.targets[i])

    return dataset._load_or_skip(index, load)[0]


def view_name(size: tuple[int, int], crop_pct: float) -> str:
    return f"eval-{size[0]}x{size[1]}-crop{crop_pct:g}"


class EvalView:
    """An opened eval view: `read_into(out, i)` fills `out` (uint8 `[h, w, 3]`, C-contiguous)
    with image `i` in one `preadv`."""

    def __init__(self, folder: Path, name: str, size: tuple[int, int], count: int, error: type[Exception]):
        self.path, self.size, self.count = folder / f"{name}.bin", size, count
        self._rows = LazyMap(self.path, np.uint8, (count, size[0], size[1], 3), mode="c", error=error)

    def read_into(self, out: np.ndarray, index: int) -> np.ndarray:
        return self._rows.read_into(out, index * self.size[0] * self.size[1] * 3)

    def __repr__(self) -> str:
        return f"EvalView({str(self.path)!r}, n={self.count}, size={self.size})"


def open_eval_view(folder: Path, fingerprint: str, count: int, size: tuple[int, int], crop_pct: float,
                   error: type[Exception]) -> EvalView | None:
    """The view of `size` in the cache `folder`, or None when there is none that matches
    (another fingerprint, count or size, an unreadable header, a data file of another size)."""
    name = view_name(size, crop_pct)
    try:
        header = json.loads((folder / f"{name}.json").read_text())
        matches = (header.get("format") == FORMAT and header.get("version") == FORMAT_VERSION
                   and header.get("fingerprint") == fingerprint and header.get("count") == count
                   and tuple(header.get("size", ())) == tuple(size))
        if not matches or (folder / f"{name}.bin").stat().st_size != count * size[0] * size[1] * 3:
            return None
    except (OSError, ValueError):
        return None
    return EvalView(folder, name, tuple(size), count, error)


def build_eval_view(dataset, folder: Path, fingerprint: str, *, num_workers: int | None, progress: bool,
                    error: type[Exception]) -> EvalView:
    """Decodes every image of an eval `dataset` (`eval_record(i)`: the file path's untransformed
    eval output) into the view of its resolution in `folder`, atomically (see the module doc)."""
    from tqdm import tqdm

    size, count = dataset.resolution, len(dataset)
    name = view_name(size, dataset.CROP_PCT)
    sweep_dead_temps(folder, "eval-*")  # left by a builder killed midway
    temp = folder / f".{name}.{_host()}.{os.getpid()}.data.tmp"
    temp_header = folder / f".{name}.{_host()}.{os.getpid()}.json.tmp"
    loader = build_loader(_EvalItems(dataset), num_workers=num_workers, batch_size=16, collate_fn=list)
    try:
        with open(temp, "wb") as out, tqdm(total=count, disable=not progress, desc="eval view", unit="img") as bar:
            for images in loader:
                for image in images:
                    out.write(np.ascontiguousarray(image.permute(1, 2, 0).numpy()).tobytes())
                bar.update(len(images))
            out.flush()
            os.fsync(out.fileno())
        header = {"format": FORMAT, "version": FORMAT_VERSION, "fingerprint": fingerprint, "count": count,
                  "size": list(size), "crop_pct": dataset.CROP_PCT}
        write_synced(temp_header, json.dumps(header).encode())
        # Another process may be committing the same view: the check and the commit happen under
        # the cache folder's lock, so a view that became valid meanwhile (and may be open in a
        # reader) is kept, and an invalid one (a crashed or damaged build's) is replaced.
        with folder_lock(folder):
            if open_eval_view(folder, fingerprint, count, size, dataset.CROP_PCT, error) is None:
                os.replace(temp, folder / f"{name}.bin")
                os.replace(temp_header, folder / f"{name}.json")  # the header commits the data
                fsync_path(folder)
    finally:
        temp.unlink(missing_ok=True)
        temp_header.unlink(missing_ok=True)
    view = open_eval_view(folder, fingerprint, count, size, dataset.CROP_PCT, error)
    assert view is not None, f"the eval view {name} just written in {folder} did not open"
    return view


class _EvalItems:
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset.eval_record(index)
