"""Building a decoded-image cache for a dataset, and finding the one built from its inputs.

Use when: a dataset's images should be decoded once (`build_image_cache`, or `recipes cache
vision`), or a dataset opens the cache built from exactly its files (`attach_image_cache`,
which names what changed when only a stale one is there). The cache itself, its layout and
its checks are `recipes.vision.cache.image_cache`.
Cost: one `stat` per input file for the fingerprint (`cache_inputs`); at build one decode per
image (DataLoader workers, split over the ranks of a process group, whose node-local folders
each receive the parts decoded elsewhere) and one write.
Adapt here: `decode_stored`, how an image is stored (change `image_cache.FORMAT_VERSION` with it).
Trade-off: the fingerprint covers sizes and mtimes, not content: a file rewritten with the same
size and mtime is not noticed.
The build reads the dataset through `CacheSource` (`recipes.vision.cache.cache_source`): `paths`,
`targets`, `root`, `max_side`, `train`, `len()`, `cache_record(i)`, `use_cache(cache)` and, for
an eval dataset, what the eval view reads (`resolution`, `CROP_PCT`, `eval_record(i)`).
Copy with: common/caches/build_ranks.py, common/caches/cache_builds.py,
  common/caches/cache_checks.py, common/caches/cache_files.py, common/loader_warning.py,
  common/loading/build_loader.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, vision/cache/cache_source.py,
  vision/cache/eval_view.py, vision/cache/eval_view_build.py, vision/cache/image_cache.py,
  vision/cache/stale_caches.py, vision/decoding/crop.py, vision/decoding/decode.py,
  vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from recipes.common.caches.cache_builds import FolderBuild, sweep_dead_temps
from recipes.common.caches.cache_checks import algorithm, file_checksums, hasher
from recipes.common.caches.cache_files import write_synced
from recipes.common.loading.build_loader import build_loader
from recipes.vision.cache.cache_source import CacheSource
from recipes.vision.cache.eval_view_build import ensure_eval_view
from recipes.vision.cache.image_cache import (
    FORMAT,
    FORMAT_VERSION,
    ImageCache,
    ImageCacheError,
    stored_shape,
)
from recipes.vision.cache.stale_caches import (
    describe_change,
    find_stale_caches,
    remove_cache,
    stat_files,
)
from recipes.vision.decoding.decode import dct_reduction, decode_image, resize_uint8
from recipes.vision.decoding.image_header import ImageHeader


def cache_inputs(
    paths, targets: np.ndarray, root: str, max_side: int
) -> tuple[str, list[str], np.ndarray]:
    """`(fingerprint, relative paths, file table)` of a dataset's files (`stale_caches.stat_files`),
    under this format's version and decode settings (`max_side`, the resize, OpenCV's version)."""
    import cv2

    return stat_files(
        paths,
        targets,
        root,
        f"v{FORMAT_VERSION}|max_side={max_side}|resize=bilinear-aa|cv2={cv2.__version__}",
    )


def decode_stored(
    data: bytes, header: ImageHeader, max_side: int, *, strict: bool, path: str, index: int
) -> np.ndarray:
    """An image as the cache stores it: `uint8 [h, w, 3]`, C-contiguous, the whole image with
    its longer side at most `max_side`, decoded at the coarsest DCT scale that allows it.

    Raises:
        ImageDecodeError: a bad file (see `decode_image`).
    """
    h, w = stored_shape(header.height, header.width, max_side)
    decoded = decode_image(
        data,
        reduce=dct_reduction((header.height, header.width), (h, w)),
        header=header,
        path=path,
        index=index,
        strict=strict,
    )
    if decoded.shape[:2] != (h, w):
        decoded = resize_uint8(decoded, (h, w)).permute(1, 2, 0).numpy()
    return np.ascontiguousarray(decoded)


def attach_image_cache(cache_dir: Path, dataset: CacheSource) -> None:
    """Opens the cache in `cache_dir` built from exactly `dataset`'s inputs and hands it to
    `dataset.use_cache`. Without one, or with one that is damaged or that `use_cache` refuses
    (`ImageCacheError`), it warns and hands over nothing: the dataset decodes from files. The
    warning names what changed when a cache of the same `root` was built from other inputs. A
    temp folder (or eval-view temp file) left by a build killed midway is removed.
    """
    fingerprint, rels, table = cache_inputs(
        dataset.paths, dataset.targets, dataset.root, dataset.max_side
    )
    path = ImageCache.folder_for(cache_dir, fingerprint)
    if cache_dir.is_dir():
        sweep_dead_temps(cache_dir, path.name)  # a build killed midway leaves its temp folder
    if not path.exists():
        stale = []
        if cache_dir.is_dir():
            stale = find_stale_caches(cache_dir, os.path.abspath(dataset.root), fingerprint)
        if stale:
            warnings.warn(
                f"Not using the image cache in {cache_dir}: it was built from other inputs "
                f"({describe_change(stale[-1], rels, table)}). Decoding from files, about 10x "
                "slower; rebuild with build_image_cache() or `recipes cache vision`, which "
                "replaces it.",
                stacklevel=3,
            )  # the caller of ImageFolderFast(...)
        return
    sweep_dead_temps(
        path, "eval-*"
    )  # an eval-view build killed midway leaves its temp files in the cache
    try:
        dataset.use_cache(ImageCache.open(path, fingerprint=fingerprint))
    except ImageCacheError as why:
        warnings.warn(f"Not using the image cache: {why} Decoding from files.", stacklevel=3)


def build_image_cache(
    dataset: CacheSource,
    cache_dir: str | os.PathLike,
    *,
    num_workers: int | None = None,
    progress: bool = True,
    distributed: bool | None = None,
) -> ImageCache:
    """Decodes every image of an `ImageFolderFast` once into a memory-mapped cache.

    Each whole image is stored with its aspect ratio, its longer side at most the dataset's
    `max_side` (decoded at the coarsest DCT scale that allows it), by DataLoader workers with a
    tqdm bar, into a temp folder renamed into place when complete. Train crops from the cache
    follow torchvision's `RandomResizedCrop` over the original image. For an eval dataset
    (`train=False`) it also stores the eval view of its resolution
    (`recipes.vision.cache.eval_view`): each image as torchvision's `Resize + CenterCrop` makes it
    from a full decode, to within a grey level; eval items are then row copies. These are not the
    uncached file path's pixels, which crops before it resizes (a mean ~2 grey levels apart, more at
    edges and on upscaled small images). A valid cache (and view) is reused; one recorded damaged
    (`damaged.json`) is rebuilt; caches of the same tree from other inputs are removed. The dataset
    then reads it.

    Args:
        dataset: an `ImageFolderFast`.
        cache_dir: the folder for caches (created).
        num_workers: decode workers per rank; `smart_num_workers()` when None.
        progress: show a progress bar (on rank 0).
        distributed: split the decoding over the ranks of the initialised process group, every
            rank of every node making the same call; None (the default): whenever a group of
            more than one rank is initialised; False: this process builds alone (the others
            wait in a barrier of yours). The ranks that share `cache_dir` are found at run time:
            each node's folder (a relative path on each node's own disk, or one shared folder)
            ends with the whole cache, the parts decoded on other nodes received over the
            process group, so the job decodes each image once (twice for an eval dataset: the
            cache and its eval view). Each node's disk holds the whole cache.

    Returns:
        The opened `ImageCache`.

    Raises:
        ImageDecodeError: a bad image when the dataset has `on_error="raise"` (with "skip",
            the next good image is stored in its place and the index is recorded).
        TypeError: `dataset` is not an `ImageFolderFast` (a `ShardSet`, a path: see the message).
    """
    if not hasattr(
        dataset, "cache_record"
    ):  # issue 27: the cache is that dataset's, read back by it
        raise TypeError(
            f"`dataset` must be an ImageFolderFast, but is {type(dataset).__name__} instead: the "
            "cache is read back by that dataset, by index, its labels checked against the "
            "dataset's targets. Image shards: decode per sample with "
            "ShardSet.dataset(transform=ShardImages(...)), or write their images to "
            "root/<class>/<key>.jpg and cache ImageFolderFast(root)."
        )
    fingerprint, _, table = cache_inputs(
        dataset.paths, dataset.targets, dataset.root, dataset.max_side
    )
    target = ImageCache.folder_for(cache_dir, fingerprint)
    build = FolderBuild(
        target,
        distributed=distributed,
        inputs=fingerprint,  # every node's folder ends with it
        local={"root": os.path.abspath(dataset.root)},
    )
    if build.needed(
        lambda: ImageCache.open(target, fingerprint=fingerprint).check_labels(dataset.targets),
        ImageCacheError,
    ):
        with build:
            checksum = build.gather(algorithm())[0]  # rank 0's, on every rank
            shapes, labels, skipped, sums = _decode_part(
                dataset, build, num_workers, progress and build.rank == 0, hasher(checksum)
            )
            write_synced(build.part("labels.bin"), labels.astype("<i8").tobytes())
            write_synced(build.part("shapes.bin"), shapes.astype("<i4").tobytes())
            write_synced(build.part("checksums.bin"), sums.tobytes())
            for name in ("images.bin", "labels.bin", "shapes.bin", "checksums.bin"):
                build.concat(name)
            skipped = sorted(i for part in build.gather(skipped) for i in part)
            if build.leader:  # in each folder (node-local disks: one per node)
                shapes = (
                    np.fromfile(build.path / "shapes.bin", "<i4").reshape(-1, 2).astype(np.int64)
                )
                offsets = np.concatenate(([0], np.cumsum(shapes[:, 0] * shapes[:, 1] * 3)))
                write_synced(build.path / "offsets.bin", offsets.astype("<i8").tobytes())
                with open(build.path / "files.npy", "wb") as f:
                    np.save(f, table, allow_pickle=False)
                table = file_checksums(
                    build.path,
                    ("labels.bin", "shapes.bin", "offsets.bin", "checksums.bin", "files.npy"),
                    checksum,
                )
            build.publish(
                {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "fingerprint": fingerprint,
                    "count": len(dataset),
                    "max_side": dataset.max_side,
                    "skipped": skipped,
                    "root": os.path.abspath(dataset.root),
                    "checksum": checksum,
                    "file_checksums": table,
                }
            )
    if build.leader:  # replaced, not left beside it
        for stale in find_stale_caches(Path(cache_dir), os.path.abspath(dataset.root), fingerprint):
            remove_cache(stale)
    cache = ImageCache.open(target, fingerprint=fingerprint)
    dataset.use_cache(cache)
    if not dataset.train:  # evaluation at this resolution serves rows of an eval view
        ensure_eval_view(
            dataset,
            cache,
            ranks=build.ranks,
            num_workers=num_workers,
            progress=progress,
            error=ImageCacheError,
        )
    return cache


class _CacheItems:
    """Items `(index, [h, w, 3] array, target, skipped)` of `block`, for the cache build."""

    def __init__(self, dataset: CacheSource, block: range):
        self.dataset = dataset
        self.block = block

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
    shapes = np.zeros((len(block), 2), np.int64)
    labels = np.zeros(len(block), np.int64)
    sums = np.zeros(len(block), "<u8")
    skipped: list[int] = []
    loader = build_loader(
        _CacheItems(dataset, block), num_workers=num_workers, batch_size=16, collate_fn=list
    )
    with (
        open(build.part("images.bin"), "wb") as out,
        tqdm(total=len(dataset), disable=not progress, desc="decoding images", unit="img") as bar,
    ):
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
