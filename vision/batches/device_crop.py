"""DeviceCropLoader: warm epochs from the decoded cache with no worker processes, cropped on the
device.

Use when: `ImageFolderFast` reads a decoded cache (`build_image_cache`) and the GPU still waits.
A DataLoader moves each batch through a fresh shared-memory segment (created and faulted in by
the worker, mapped and faulted in again by the pin-memory thread, then unmapped): for 256
images at 224 px that is 38 MB and ~9,400 page faults per batch on the main-process side,
whatever the worker count. On a 16-core H200 node the warm cache stayed at 3,500 img/s with 4
or 12 workers. Here threads of the main process `preadv` each cached image straight from the
page cache into the corner of a reused `[M, M, 3]` slot (M = the cache's `max_side`) of a
(pinned, with CUDA) batch buffer, one copy moves it to the device, and random-resized-crop
(over each whole image, as torchvision's), resize, flip and normalisation run there for the
whole batch (`torchvision.ops.roi_align`: bilinear with area averaging when shrinking).
Cost: per image one `preadv` of h*w*3 bytes in a thread (the GIL is released during the
read); per batch one host-to-device copy of B*M*M*3 bytes and four kernels. No IPC, no
per-batch allocation on the host, no pickling.
Adapt here: `MEAN`/`STD`, `threads`, or subclass and override `boxes` for other crops.
Eval with an eval view (`recipes.vision.cache.eval_view`) copies its rows as they are: torchvision's
pixels. Trade-off: whole padded slots cross to the device (M*M instead of size*size bytes per image,
4x at max_side = 2 x size). Pixels match the CPU path's `resize_uint8` within ~0.3 grey levels on
average.
Copy with: vision/batches/batch_buffers.py, vision/batches/device.py, vision/decoding/crop.py,
  vision/decoding/decode.py, vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from recipes.vision.batches.device import IMAGENET_MEAN, IMAGENET_STD
from recipes.vision.decoding.crop import eval_box, random_resized_box


class DeviceCropLoader:
    """Batches `(images [B, 3, H, W] float on device, channels_last; targets int64 [B])`.

    Args:
        dataset: an `ImageFolderFast` with a decoded cache attached (`build_image_cache`).
        batch_size: images per batch.
        sampler: any index sampler (e.g. `DistributedSampler`); `set_epoch` reaches it.
        shuffle: without a sampler, a fresh permutation per epoch from `(seed, epoch)`.
        seed: seeds the order (without a sampler) and the crops and flips of each batch.
        drop_last: drop the last, smaller batch.
        device: where crops are made and batches delivered.
        dtype: the output float dtype (`torch.bfloat16` under bf16 autocast).
        threads: reader threads; `threads + 1` batches are in flight.

    Raises:
        ValueError: no cache attached, a uint8 `transform` set on the dataset, bad sizes.
        RuntimeError: `device` is CUDA but CUDA is not available.

    Example:
        >>> build_image_cache(train_set, "/nvme/cache")
        >>> sampler = DistributedSampler(train_set)
        >>> loader = DeviceCropLoader(train_set, batch_size=256, sampler=sampler)
        >>> for epoch in range(epochs):
        ...     loader.set_epoch(epoch)
        ...     for images, targets in loader:
        ...         loss = criterion(model(images), targets)
    """

    MEAN = IMAGENET_MEAN
    STD = IMAGENET_STD

    def __init__(
        self,
        dataset,
        *,
        batch_size: int,
        sampler=None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.float32,
        threads: int = 4,
    ):
        if getattr(dataset, "cache", None) is None:
            raise ValueError(
                "DeviceCropLoader reads the decoded cache, but the dataset has none attached: run "
                "build_image_cache(dataset, cache_dir) first (or `recipes cache vision`)."
            )
        if dataset.transform is not None:
            raise ValueError(
                "DeviceCropLoader cannot apply the dataset's uint8 `transform` (crops happen on "
                "the device); apply it to the returned batch instead, or use make_loader."
            )
        for name, value in (("batch_size", batch_size), ("threads", threads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, but is {value!r} instead.")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "DeviceCropLoader: device='cuda' but CUDA is not available here; pass "
                "device='cpu' (crops on the CPU) or use make_loader for CPU training."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.dtype = dtype
        self.threads = threads
        self.epoch = 0
        std = torch.tensor(self.STD, dtype=torch.float32)
        self._scale = (1.0 / (255.0 * std)).view(1, -1, 1, 1).to(self.device)
        self._shift = (
            (-torch.tensor(self.MEAN, dtype=torch.float32) / std).view(1, -1, 1, 1).to(self.device)
        )

    def set_epoch(self, epoch: int) -> None:
        """A new order (and new crops) for `epoch`; passed on to the sampler."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.dataset)
        if self.sampler is not None:
            n = len(self.sampler)
        if self.drop_last:
            return n // self.batch_size
        return -(-n // self.batch_size)

    def _order(self) -> np.ndarray:
        if self.sampler is not None:
            return np.fromiter((int(i) for i in self.sampler), np.int64)
        if not self.shuffle:
            return np.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).numpy()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order()
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        cache = self.dataset.cache
        view = self._view()  # eval with an eval view: its rows, already torchvision's crops
        labels = np.asarray(
            cache.labels
        )  # opens the cache file in this process before the threads do
        buffers = [
            _Buffer(self.batch_size, cache.max_side, self.device) for _ in range(self.threads + 1)
        ]
        pending: collections.deque = collections.deque()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="device-crop") as pool:
            for k, indices in enumerate(batches):
                buffer = buffers[k % len(buffers)]
                buffer.wait_until_free()  # its previous batch's copy to the device has finished
                pending.append(
                    (k, indices, buffer, pool.submit(_read, cache, indices, buffer.host, view))
                )
                if len(pending) > self.threads:
                    yield self._finish(*pending.popleft(), labels)
            while pending:
                yield self._finish(*pending.popleft(), labels)

    def _finish(self, k: int, indices: np.ndarray, buffer: _Buffer, future, labels: np.ndarray):
        future.result()
        n = len(indices)
        images = buffer.host[:n].to(self.device, non_blocking=True)
        buffer.mark_in_use()
        rng = np.random.default_rng([self.seed, self.epoch, k])
        view = self._view()
        if view is not None:  # each slot holds its eval-view row: the identity box, resampled 1:1
            boxes = np.tile([0, 0, *view.size], (n, 1))
            flips = np.zeros(n, bool)
        else:
            boxes, flips = self.boxes(self.dataset.cache.shapes[indices], rng)
        out = crop_resize(images, boxes, self.dataset.resolution, flips)
        out = torch.addcmul(self._shift, out, self._scale).to(self.dtype)
        targets = torch.from_numpy(labels[indices]).to(self.device, non_blocking=True)
        return out.contiguous(memory_format=torch.channels_last), targets

    def _view(self):
        view = self.dataset.eval_view
        if view is None or max(view.size) > self.dataset.cache.max_side:
            return None
        return view

    def boxes(self, shapes: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """`(int [n, 4] top/left/height/width boxes, bool [n] flips)` for images of `shapes`
        (`[n, 2]` h, w): the dataset's random-resized-crop and flip for `train`, else its eval
        crop at the current resolution."""
        ds = self.dataset
        if ds.train:
            boxes = np.array(
                [random_resized_box(int(h), int(w), rng, ds.SCALE, ds.RATIO) for h, w in shapes]
            )
            return boxes, rng.random(len(shapes)) < 0.5
        out = ds.resolution
        return np.array([eval_box(int(h), int(w), out, ds.CROP_PCT) for h, w in shapes]), np.zeros(
            len(shapes), bool
        )


def crop_resize(
    images: torch.Tensor, boxes: np.ndarray, out: tuple[int, int], flips: np.ndarray
) -> torch.Tensor:
    """Crops `boxes` (top, left, height, width) of `uint8 [B, M, M, 3]` images and resizes each
    to `out`, on the images' device: `float [B, 3, H, W]` in 0..255, rounded like a uint8 resize."""
    from torchvision.ops import roi_align

    x = images.permute(0, 3, 1, 2).float()
    b = torch.as_tensor(boxes, dtype=torch.float32)
    rois = torch.stack(
        [
            torch.arange(len(b), dtype=torch.float32),
            b[:, 1],
            b[:, 0],
            b[:, 1] + b[:, 3],
            b[:, 0] + b[:, 2],
        ],
        dim=1,
    ).to(x.device, non_blocking=True)
    y = roi_align(
        x.contiguous(),
        rois,
        output_size=tuple(out),
        spatial_scale=1.0,
        sampling_ratio=-1,
        aligned=True,
    )
    if flips.any():
        mask = torch.as_tensor(flips).to(y.device, non_blocking=True).view(-1, 1, 1, 1)
        y = torch.where(mask, y.flip(-1), y)
    return y.round_().clamp_(0, 255)


def _read(cache, indices: np.ndarray, host: torch.Tensor, view=None) -> None:
    for row, index in enumerate(indices):
        slot = host[row].numpy()
        if view is not None:
            h, w = view.size
            view.read_into([slot[r, :w] for r in range(h)], int(index))
        else:
            h, w = cache.read_padded(int(index), slot)
        # Replicate the last column and row: bilinear samples at a crop's far edge reach one
        # pixel past the image, which must be the edge (as at a real border), not the slot's
        # stale bytes from another image.
        if w < slot.shape[1]:
            slot[:h, w] = slot[:h, w - 1]
        if h < slot.shape[0]:
            slot[h, : w + 1] = slot[h - 1, : w + 1]


class _Buffer:
    """A reused host batch buffer (pinned with CUDA), with an event marking the end of its
    last copy to the device, so it is never overwritten while the copy still reads it."""

    def __init__(self, batch_size: int, side: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.empty((batch_size, side, side, 3), dtype=torch.uint8, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def mark_in_use(self) -> None:
        if self.event is not None:
            self.event.record()

    def wait_until_free(self) -> None:
        if self.event is not None:
            self.event.synchronize()
