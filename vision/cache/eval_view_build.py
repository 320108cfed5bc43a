"""Building an eval view of a decoded image cache: every eval image decoded once more, written
beside the cache's whole images (the view's files: `eval_view.py`).

Use when: `build_image_cache` runs on an eval dataset (`ensure_eval_view`: the view of its
resolution, unless a valid one is there), or to build one directly (`build_eval_view`).
Each image is stored as torchvision makes it: a full decode, the whole image resized
(antialiased bilinear, Pillow's filter) to `Resize(resize)`'s size, then `CenterCrop(size)`'s
region (`eval_image`, `eval_record_of`).
Cost: one more decode per image (in `build_loader`'s workers), `h * w * 3` bytes written per
image and fsynced.
Adapt here: `eval_image`, what a view stores (change `eval_view.FORMAT_VERSION` with it).
Trade-off: the files are written into a temp folder (`.<name>.<host>.<pid>.<random>.tmp`, swept
when its builder on this host is dead; in a distributed build each rank writes its block there
as a part, and each node's leader joins them after receiving the parts written on other nodes)
and fsynced; under the cache folder's lock, unless a valid view appeared meanwhile, the `.bin`
and `.sums` are renamed into place first and the `.json`, renamed last, commits them: a crash
leaves the old view or none, never a half-written one.
Copy with: common/caches/build_ranks.py, common/caches/cache_builds.py,
  common/caches/cache_checks.py, common/caches/cache_files.py, common/loader_warning.py,
  common/loading/build_loader.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, vision/cache/cache_source.py,
  vision/cache/eval_view.py, vision/decoding/crop.py, vision/decoding/decode.py,
  vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recipes.common.caches.build_ranks import BuildRanks
from recipes.common.caches.cache_builds import sweep_dead_temps
from recipes.common.caches.cache_checks import algorithm, clear_damage, file_checksum, hasher
from recipes.common.caches.cache_files import _host, _seal, folder_lock, fsync_path, write_synced
from recipes.common.loading.build_loader import build_loader
from recipes.vision.cache.cache_source import CacheSource
from recipes.vision.cache.eval_view import (
    FORMAT,
    FORMAT_VERSION,
    EvalView,
    open_eval_view,
    view_name,
)
from recipes.vision.decoding.crop import _resized, resize_side
from recipes.vision.decoding.decode import decode_image, resize_uint8
from recipes.vision.decoding.image_header import ImageHeader

if TYPE_CHECKING:  # only an annotation: image_cache.py stays out of this file's copy set
    from recipes.vision.cache.image_cache import ImageCache


def eval_image(decoded: np.ndarray, size: tuple[int, int], crop_pct: float):
    """torchvision's `Resize(resize_side(size)) + CenterCrop(size)` of a decoded `[H, W, 3]`
    uint8 image: uint8 `[3, h, w]`, channels-last in memory."""
    new_h, new_w = _resized(decoded.shape[0], decoded.shape[1], resize_side(size, crop_pct))
    resized = resize_uint8(decoded, (new_h, new_w))
    top = int(round((new_h - size[0]) / 2.0))
    left = int(round((new_w - size[1]) / 2.0))
    return resized[:, top : top + size[0], left : left + size[1]]


def eval_record_of(
    path: str,
    data: bytes,
    header: ImageHeader,
    size: tuple[int, int],
    crop_pct: float,
    *,
    index: int | None,
    strict: bool,
):
    """What an eval view stores for an encoded image: `eval_image` of a full decode of `data`.

    Raises:
        ImageDecodeError: a bad file (see `decode_image`)."""
    decoded = decode_image(data, reduce=1, header=header, path=path, index=index, strict=strict)
    return eval_image(decoded, size, crop_pct)


def build_eval_view(
    dataset: CacheSource,
    folder: Path,
    fingerprint: str,
    *,
    num_workers: int | None,
    progress: bool,
    error: type[Exception],
    ranks: BuildRanks | None = None,
) -> EvalView:
    """Decodes every image of an eval `dataset` (`eval_record(i)`: torchvision's eval pixels)
    into the view of its resolution in `folder`, atomically (see the module doc); a record of
    damage to the view it replaces (`damaged.json`) is removed with it. With `ranks` (a
    distributed build), each rank decodes a contiguous block into a part file, every folder
    receives the parts written elsewhere (`build_ranks.py`), and each folder's leader joins and
    commits them there. Collective over `ranks`."""
    ranks = ranks or BuildRanks.alone()
    size = dataset.resolution
    count = len(dataset)
    name = view_name(size, dataset.CROP_PCT)
    parts = None
    if ranks.leader:
        sweep_dead_temps(folder, "eval-*")  # left by a builder killed midway
        parts = tempfile.mkdtemp(
            prefix=f".{name}.{_host()}.{os.getpid()}.", suffix=".tmp", dir=folder
        )
    parts = Path(ranks.from_leader(parts))
    try:
        checksum = ranks.gather(algorithm())[0]  # rank 0's, on every rank
        _decode_block(dataset, parts, ranks, num_workers, progress and ranks.rank == 0, checksum)
        ranks.exchange(lambda rank: [parts / f"data.part{rank}", parts / f"sums.part{rank}"])
        if ranks.leader:
            _commit(dataset, folder, fingerprint, parts, ranks.world, checksum, error)
    finally:
        ranks.barrier()  # every rank is done with the parts before they go
        if ranks.leader:
            shutil.rmtree(parts, ignore_errors=True)
    view = open_eval_view(folder, fingerprint, count, size, dataset.CROP_PCT, error)
    assert view is not None, f"the eval view {name} just written in {folder} did not open"
    return view


def _decode_block(
    dataset: CacheSource,
    parts: Path,
    ranks: BuildRanks,
    num_workers: int | None,
    progress: bool,
    checksum: str,
) -> None:
    """This rank's block of the eval images, in index order, into `data.part<rank>` (rows) and
    `sums.part<rank>` (their checksums)."""
    from tqdm import tqdm

    count = len(dataset)
    block = range(count * ranks.rank // ranks.world, count * (ranks.rank + 1) // ranks.world)
    loader = build_loader(
        _EvalItems(dataset, block), num_workers=num_workers, batch_size=16, collate_fn=list
    )
    hash_ = hasher(checksum)
    sums = np.zeros(len(block), "<u8")
    done = 0
    with (
        open(parts / f"data.part{ranks.rank}", "wb") as out,
        tqdm(total=count, disable=not progress, desc="eval view", unit="img") as bar,
    ):
        for images in loader:
            for image in images:
                row = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
                out.write(row.tobytes())
                sums[done] = hash_(row)
                done = done + 1
            bar.update(len(images) * ranks.world)
        out.flush()
        os.fsync(out.fileno())
    write_synced(parts / f"sums.part{ranks.rank}", sums.tobytes())


def _commit(
    dataset: CacheSource,
    folder: Path,
    fingerprint: str,
    parts: Path,
    world: int,
    checksum: str,
    error: type[Exception],
) -> None:
    """A leader: every rank's parts joined into the view's files, then committed in `folder`."""
    size = dataset.resolution
    count = len(dataset)
    name = view_name(size, dataset.CROP_PCT)
    data = parts / "data"
    sums = parts / "sums"
    for kind, joined in (("data", data), ("sums", sums)):
        os.replace(parts / f"{kind}.part0", joined)
        with open(joined, "ab") as out:
            for rank in range(1, world):
                with open(parts / f"{kind}.part{rank}", "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 24)
            out.flush()
            os.fsync(out.fileno())
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "count": count,
        "size": list(size),
        "crop_pct": dataset.CROP_PCT,
        "checksum": checksum,
        "sums_checksum": file_checksum(sums, checksum),
    }
    write_synced(parts / "json", json.dumps({**header, "header_sha256": _seal(header)}).encode())
    # Another process may be committing the same view: the check and the commit happen under
    # the cache folder's lock, so a view that became valid meanwhile (and may be open in a
    # reader) is kept, and an invalid one (a crashed or damaged build's) is replaced.
    with folder_lock(folder):
        if open_eval_view(folder, fingerprint, count, size, dataset.CROP_PCT, error) is None:
            os.replace(data, folder / f"{name}.bin")
            os.replace(sums, folder / f"{name}.sums")
            os.replace(parts / "json", folder / f"{name}.json")  # the header commits the data
            clear_damage(folder, f"{name}.bin")  # the damage recorded was the replaced file's
            fsync_path(folder)


def ensure_eval_view(
    dataset: CacheSource,
    cache: ImageCache,
    *,
    ranks: BuildRanks | None = None,
    num_workers: int | None,
    progress: bool,
    error: type[Exception],
) -> None:
    """After a cache build: the eval view of an eval `dataset`'s resolution in `cache`'s folder,
    unless a valid one is there; copied from a folder that holds one to those that lack it, or
    built by every rank of `ranks` when none holds it."""
    ranks = ranks or BuildRanks.alone()
    missing = None
    if ranks.leader:
        missing = (
            open_eval_view(
                cache.path,
                cache.fingerprint,
                cache.count,
                dataset.resolution,
                dataset.CROP_PCT,
                error,
            )
            is None
        )
    answers = ranks.gather(missing)
    holders = [r for r in ranks.leaders if not answers[r]]
    if len(holders) == len(ranks.leaders):
        return
    if not holders:
        build_eval_view(
            dataset,
            cache.path,
            cache.fingerprint,
            num_workers=num_workers,
            progress=progress,
            error=error,
            ranks=ranks,
        )
        return
    if ranks.leader:
        _copy_view(dataset, cache, ranks, holders[0], needs=bool(missing), error=error)
    ranks.barrier()  # no rank reads its folder's view before it is in place


def _copy_view(
    dataset: CacheSource,
    cache: ImageCache,
    ranks: BuildRanks,
    source: int,
    *,
    needs: bool,
    error: type[Exception],
) -> None:
    """Leaders: `source`'s view files into each leader that lacks them, committed as a build's."""
    name = view_name(dataset.resolution, dataset.CROP_PCT)
    kinds = ("bin", "sums", "json")  # the header last: it commits the data
    if ranks.rank == source:
        ranks.send(source, [cache.path / f"{name}.{kind}" for kind in kinds])
        return
    parts = None
    targets = [None for _ in kinds]  # this folder holds a valid view: nothing to receive
    if needs:
        prefix = f".{name}.{_host()}.{os.getpid()}."
        parts = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=cache.path))
        targets = [parts / kind for kind in kinds]
    try:
        ranks.send(source, targets)
        if parts is not None:
            with folder_lock(cache.path):
                if (
                    open_eval_view(
                        cache.path,
                        cache.fingerprint,
                        cache.count,
                        dataset.resolution,
                        dataset.CROP_PCT,
                        error,
                    )
                    is None
                ):
                    for kind in kinds:
                        os.replace(parts / kind, cache.path / f"{name}.{kind}")
                    clear_damage(cache.path, f"{name}.bin")
                    fsync_path(cache.path)
    finally:
        if parts is not None:
            shutil.rmtree(parts, ignore_errors=True)


class _EvalItems:
    def __init__(self, dataset: CacheSource, block: range):
        self.dataset = dataset
        self.block = block

    def __len__(self) -> int:
        return len(self.block)

    def __getitem__(self, position: int):
        return self.dataset.eval_record(self.block[position])
