"""Decoded-image cache: every image decoded once into one memory-mapped uint8 file.

Use when: the same images are read for many epochs and JPEG decoding is the bottleneck
(CPU-bound loaders on few cores). Warm epochs read `[S, S, 3]` arrays from the page cache.
Cost: `N * S * S * 3` bytes of disk (196 KB per image at S=256: 250 GB for ImageNet-1k, so
use it for subsets, smaller S, or fast local NVMe) and one decode pass (`build_image_cache`,
in parallel DataLoader workers).
Adapt here: `S` (the dataset's `cache_side`), or store JPEG re-encodes instead of pixels.
Trade-off: the cache holds a (near-)centre square of the shorter-side-resized image, so random
crops cannot reach the far ends of the longer side (as in FFCV's `max_resolution` stores).

File layout (little-endian), written to a temp file, fsynced and renamed into place:
  [4096 bytes: magic b"RCPIMG01" + JSON header, space-padded]
  [labels: int64 x N] [images: uint8 x N x S x S x 3]
The header holds the format version, the fingerprint of the inputs (file list, sizes and
mtimes, labels, S, decode settings), N, S and the skipped indices. A file whose magic,
version, fingerprint or byte size does not match is never served.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recipes.common.atomic import fsync_dir, pid_alive

MAGIC = b"RCPIMG01"
FORMAT_VERSION = 1
HEADER_BYTES = 4096


class CacheMismatch(Exception):
    """Internal: why a cache file was not served."""


@dataclass
class ImageCache:
    """An opened, validated decoded-image cache (the memory map opens lazily per process)."""

    path: Path
    count: int
    side: int
    fingerprint: str
    skipped: tuple[int, ...]
    skipped_count: int = 0

    def __post_init__(self):
        self._pid = None
        self._images = None
        self._labels = None
        self._fd = None

    @staticmethod
    def file_for(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
        return Path(cache_dir) / f"images-{fingerprint[:24]}.bin"

    @classmethod
    def open(cls, path: str | os.PathLike, *, fingerprint: str | None = None) -> ImageCache:
        """Validates the header and size of `path`; raises `CacheMismatch` with the reason."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES)
            size = path.stat().st_size
        except OSError as error:
            raise CacheMismatch(f"cannot read {path}: {error}") from None
        if len(raw) < HEADER_BYTES or not raw.startswith(MAGIC):
            raise CacheMismatch(f"{path} is not a recipes image cache (bad magic or short header)")
        try:
            header = json.loads(raw[len(MAGIC):].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CacheMismatch(f"{path} has a corrupt header") from None
        if not isinstance(header, dict) or not {"count", "side", "fingerprint"} <= set(header):
            raise CacheMismatch(f"{path} has a header without the cache fields")
        if header.get("version") != FORMAT_VERSION:
            raise CacheMismatch(f"{path} has format version {header.get('version')}, expected {FORMAT_VERSION}")
        if fingerprint is not None and header.get("fingerprint") != fingerprint:
            raise CacheMismatch(f"{path} was built from other inputs (fingerprint differs)")
        count, side = int(header["count"]), int(header["side"])
        expected = HEADER_BYTES + 8 * count + count * side * side * 3
        if size != expected:
            raise CacheMismatch(f"{path} is {size} bytes, expected {expected} (truncated or corrupt)")
        skipped = tuple(header.get("skipped", ()))
        return cls(path, count, side, header["fingerprint"], skipped, header.get("skipped_count", len(skipped)))

    def _maps(self):
        if self._pid != os.getpid():  # reopen in each worker process
            # Copy-on-write maps: writable views for torch.from_numpy, the file is never written.
            self._labels = np.memmap(self.path, np.int64, "c", HEADER_BYTES, (self.count,))
            self._images = np.memmap(
                self.path, np.uint8, "c", HEADER_BYTES + 8 * self.count, (self.count, self.side, self.side, 3)
            )
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._images, self._labels

    def read_into(self, index: int, out: np.ndarray, *, first_row: int = 0) -> np.ndarray:
        """Reads rows `first_row : first_row + len(out)` of image `index` into `out`
        (`uint8 [rows, S, 3]`, C-contiguous) with one `preadv`; returns `out`."""
        self._maps()
        row_bytes = self.side * 3
        offset = HEADER_BYTES + 8 * self.count + int(index) * self.side * row_bytes + first_row * row_bytes
        if os.preadv(self._fd, [out], offset) != out.nbytes:
            raise OSError(f"short read from {self.path} at image {index}: the cache file shrank")
        return out

    def read_batch(self, indices) -> np.ndarray:
        """Images `[B, S, S, 3]` for `indices`, copied by `preadv` into one fresh array.

        A read copies from the page cache in the kernel; touching a memory map instead costs
        a page fault per 4 KiB in every new worker process, which is slower on warm epochs.
        """
        self._maps()
        per_image = self.side * self.side * 3
        base = HEADER_BYTES + 8 * self.count
        out = np.empty((len(indices), self.side, self.side, 3), np.uint8)
        for row, index in enumerate(indices):
            if os.preadv(self._fd, [out[row]], base + int(index) * per_image) != per_image:
                raise OSError(f"short read from {self.path} at image {index}: the cache file shrank")
        return out

    @property
    def images(self) -> np.ndarray:
        """`uint8 [N, S, S, 3]` memory map."""
        return self._maps()[0]

    @property
    def labels(self) -> np.ndarray:
        """`int64 [N]` memory map."""
        return self._maps()[1]

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_pid=None, _images=None, _labels=None, _fd=None)
        return state


def write_cache(path: Path, fingerprint: str, count: int, side: int, fill, *, root: str | None = None) -> None:
    """Writes a cache atomically: `fill(images_memmap, temp_path) -> (labels, skipped)` fills
    the pixels of a temp file, which is then fsynced and renamed to `path`. Concurrent writers
    each rename a complete file, so readers see one whole cache or the other.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_temps(path.parent)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.truncate(HEADER_BYTES + 8 * count + count * side * side * 3)
        images = np.memmap(tmp, np.uint8, "r+", HEADER_BYTES + 8 * count, (count, side, side, 3))
        labels, skipped = fill(images, tmp)
        images.flush()
        del images
        header = {"version": FORMAT_VERSION, "fingerprint": fingerprint, "count": count,
                  "side": side, "skipped": sorted(int(i) for i in skipped), "root": root}
        blob = MAGIC + json.dumps(header).encode("utf-8")
        if len(blob) > HEADER_BYTES:  # many skipped files: keep the count only
            header["skipped"] = []
            header["skipped_count"] = len(skipped)
            blob = MAGIC + json.dumps(header).encode("utf-8")
        with open(tmp, "r+b") as f:
            f.write(blob.ljust(HEADER_BYTES, b" "))
            f.write(np.ascontiguousarray(labels, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def sweep_dead_temps(folder: Path) -> None:
    """Removes temp files whose writer process no longer exists."""
    for tmp in folder.glob(".images-*.tmp"):
        try:
            pid = int(tmp.name.split(".")[-3])
        except (ValueError, IndexError):
            continue
        if not pid_alive(pid):
            tmp.unlink(missing_ok=True)


def build_image_cache(dataset, cache_dir: str | os.PathLike, *, num_workers: int | None = None,
                      progress: bool = True, distributed: bool = False) -> ImageCache:
    """Decodes every image of an `ImageFolderFast` once into a memory-mapped cache.

    Images are decoded in parallel DataLoader workers (with `worker_init`) at the dataset's
    `cache_side` S (shorter side resized to S, a centred S x S square), with a tqdm bar, into a temp
    file that is renamed into place when complete. An existing valid cache is reused. The
    dataset reads the cache from then on.

    Args:
        dataset: an `ImageFolderFast`.
        cache_dir: the folder for cache files (created).
        num_workers: decode workers; `smart_num_workers()` when None.
        progress: show a progress bar.
        distributed: split the decoding over the ranks of the initialised process group; every
            rank must make the same call.

    Returns:
        The opened `ImageCache`.

    Raises:
        ImageDecodeError: a bad image when the dataset has `on_error="raise"` (with "skip",
            the next good image is stored in its place and the index is recorded).
    """
    from recipes.common.sizing import smart_num_workers
    from recipes.vision.cache_manifest import remove_cache, stale_caches, write_sidecar

    fingerprint, _, table = dataset.cache_inputs()
    path = ImageCache.file_for(cache_dir, fingerprint)
    root = os.path.abspath(dataset.root)
    workers = smart_num_workers() if num_workers is None else num_workers
    rank, world = _distributed() if distributed else (0, 1)
    if world > 1:
        cache = _build_distributed(dataset, path, fingerprint, root, table, workers, progress, rank, world)
        dataset.attach_cache(cache)
        return cache
    try:
        cache = ImageCache.open(path, fingerprint=fingerprint)
    except CacheMismatch:
        write_cache(path, fingerprint, len(dataset), dataset.cache_side,
                    lambda images, _: _decode_into(dataset, images, workers, progress), root=root)
        write_sidecar(path, table)
        cache = ImageCache.open(path, fingerprint=fingerprint)
    for stale in stale_caches(Path(cache_dir), root, fingerprint):  # replaced, not left beside it
        remove_cache(stale)
    dataset.attach_cache(cache)
    return cache


def _distributed() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _build_distributed(dataset, path, fingerprint, root, table, workers, progress, rank, world) -> ImageCache:
    """Every rank decodes its block of images into rank 0's temp file; rank 0 gathers the
    labels, writes the header and publishes (rename) once all blocks are in; then all open it.
    A rank that dies breaks the collectives before the rename: nothing is published, and the
    temp file is removed by rank 0 (or swept as a dead writer's). `cache_dir` must be a folder
    every rank can write: node-local for one node, a shared file system across nodes."""
    import torch.distributed as dist

    from recipes.vision.cache_manifest import remove_cache, stale_caches, write_sidecar

    n, side = len(dataset), dataset.cache_side
    block = range(n * rank // world, n * (rank + 1) // world)
    decision = [None]
    if rank == 0:
        try:
            ImageCache.open(path, fingerprint=fingerprint)
            decision[0] = "reuse"
        except CacheMismatch:
            decision[0] = "build"
    dist.broadcast_object_list(decision, src=0)
    if decision[0] == "build":
        def fill(images, tmp):  # rank 0's share, and the others' results
            dist.broadcast_object_list([str(tmp)], src=0)
            return _gather_blocks(_decode_into(dataset, images, workers, progress, block), block, world)

        if rank == 0:
            write_cache(path, fingerprint, n, side, fill, root=root)
            write_sidecar(path, table)
            for stale in stale_caches(path.parent, root, fingerprint):
                remove_cache(stale)
        else:
            where = [None]
            dist.broadcast_object_list(where, src=0)
            images = np.memmap(where[0], np.uint8, "r+", HEADER_BYTES + 8 * n, (n, side, side, 3))
            result = _decode_into(dataset, images, workers, False, block)
            images.flush()  # in the page cache before rank 0's fsync
            del images
            _gather_blocks(result, block, world)
    dist.barrier()  # rank 0 has published
    return ImageCache.open(path, fingerprint=fingerprint)


def _gather_blocks(result, block: range, world: int):
    """All ranks' (labels, skipped) of their blocks, assembled (identical on every rank)."""
    import torch.distributed as dist

    labels, skipped = result
    gathered = [None] * world
    dist.all_gather_object(gathered, (block.start, labels[block.start:block.stop].tolist(), list(skipped)))
    for start, block_labels, _ in gathered:
        labels[start:start + len(block_labels)] = block_labels
    return labels, sorted(i for _, _, s in gathered for i in s)


class _CacheSource:
    """Items `(index, [S, S, 3] array, target, skipped)` for the cache build."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return (index, *self.dataset.decode_for_cache(index))


def _as_numpy_batch(batch):
    index, arrays, targets, skipped = zip(*batch, strict=True)
    return np.asarray(index), np.stack(arrays), np.asarray(targets), np.asarray(skipped, bool)


def _decode_into(dataset, images: np.ndarray, workers: int, progress: bool, block: range | None = None):
    from torch.utils.data import DataLoader, Subset
    from tqdm import tqdm

    from recipes.common.worker import worker_init

    labels = np.zeros(len(dataset), np.int64)
    skipped: list[int] = []
    source = _CacheSource(dataset) if block is None else Subset(_CacheSource(dataset), block)
    loader = DataLoader(source, batch_size=16, num_workers=workers,
                        collate_fn=_as_numpy_batch, worker_init_fn=worker_init if workers else None)
    with tqdm(total=len(source), disable=not progress, desc="decoding images", unit="img") as bar:
        for index, arrays, targets, was_skipped in loader:
            images[index] = arrays
            labels[index] = targets
            skipped.extend(index[was_skipped].tolist())
            bar.update(len(index))
    return labels, skipped
