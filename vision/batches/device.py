"""uint8 batches to the device, normalised there: 4x fewer bytes over PCIe than float32.

Use when: the loader's output goes to a GPU. Collating uint8 `[B, 3, H, W]` and converting to
float on the device moves 150 KB per 224x224 image instead of 600 KB, shrinks pinned buffers
and worker IPC by the same factor, and the normalisation is one fused kernel on the GPU.
Cost: `uint8_collate` is one copy per image into a (shared-memory, in workers) batch tensor;
`DeviceNormalize` is one non-blocking copy and one multiply-add on the device.
Adapt here: `mean`/`std` (ImageNet's by default in the constants below), `channels_last`.
Trade-off: augmentations that need float (colour jitter, mixup) move to the device too.
Copy with: vision/batches/batch_buffers.py, vision/decoding/decode.py,
  vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recipes.vision.batches.batch_buffers import copy_image, new_uint8_batch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def uint8_collate(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks `(uint8 [3, H, W], target)` items into `uint8 [B, 3, H, W]` and `int64 [B]`.

    The batch keeps the items' memory layout (channels-last items, as the cache produces, give
    a `channels_last` batch; contiguous items a contiguous one), so filling it copies rows
    instead of transposing pixels; `DeviceNormalize(channels_last=...)` picks the layout the
    model wants on the device. Inside a
    worker it is allocated in shared memory directly (as `default_collate` does), so it
    crosses to the main process without another copy; the loader's pin-memory thread pins it
    when `pin_memory=True`.

    Raises:
        TypeError: an image that is not a uint8 tensor, or images of different shapes
            (naming the position in the batch).
    """
    if not batch:
        raise ValueError("uint8_collate got an empty batch.")
    first = batch[0][0]
    for position, (image, _) in enumerate(batch):
        if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8:
            raise TypeError(
                f"uint8_collate: item {position} is {type(image).__name__} "
                f"{getattr(image, 'dtype', '')}, expected a uint8 tensor."
            )
        if image.shape != first.shape:
            raise TypeError(
                f"uint8_collate: item {position} has shape {tuple(image.shape)} but item 0 "
                f"has {tuple(first.shape)}; all images in a batch must share a size."
            )
    targets = torch.tensor([int(t) for _, t in batch], dtype=torch.int64)
    rows = [image for image, _ in batch]
    whole = _batch_of_rows(rows)
    if (
        whole is not None
    ):  # the dataset already filled one batch tensor (ImageFolderFast.__getitems__)
        return whole, targets
    channels, _, width = first.shape
    channels_last = first.stride() == (
        1,
        width * channels,
        channels,
    )  # keep the items' layout: no transposes
    images = new_uint8_batch(len(batch), *first.shape, channels_last=channels_last)
    for position, image in enumerate(rows):
        copy_image(images[position], image)
    return images, targets


def _batch_of_rows(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The batch tensor when `rows` are its rows, in order, filling its whole storage."""
    storage = rows[0].untyped_storage()
    channels, height, width = rows[0].shape
    per_image = channels * height * width
    if storage.nbytes() != per_image * len(rows) or rows[0].stride() != (
        1,
        width * channels,
        channels,
    ):
        return None
    start = storage.data_ptr()
    for position, row in enumerate(rows):
        if (
            row.untyped_storage().data_ptr() != start
            or row.data_ptr() != start + position * per_image
            or row.stride() != rows[0].stride()
        ):
            return None
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat.view(len(rows), height, width, channels).permute(0, 3, 1, 2)


class DeviceNormalize:
    """Moves a uint8 batch to `device` (non-blocking) and normalises it there.

    `out = (x / 255 - mean) / std`, computed as one multiply-add in `dtype`.

    Args:
        mean: per-channel means in [0, 1] (e.g. `IMAGENET_MEAN`).
        std: per-channel standard deviations in [0, 1].
        device: where to normalise ("cuda", "cpu", a `torch.device`).
        dtype: output float dtype (`torch.float16`/`bfloat16` for mixed precision).
        channels_last: return `channels_last` memory format (faster convolutions on GPUs).

    Example:
        >>> normalize = DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD, device="cuda")
        >>> for images, targets in loader:
        ...     images, targets = normalize(images, targets)
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        device,
        dtype=torch.float32,
        channels_last: bool = False,
    ):
        if len(mean) != len(std):
            raise ValueError(
                f"`mean` and `std` must have the same length, but have {len(mean)} and {len(std)}."
            )
        if any(s <= 0 for s in std):
            raise ValueError(f"`std` must be positive, but is {tuple(std)} instead.")
        self.device = torch.device(device)
        self.dtype = dtype
        self.channels_last = channels_last
        std_t = torch.tensor(std, dtype=torch.float32)
        self.scale = (1.0 / (255.0 * std_t)).view(1, -1, 1, 1).to(self.device, dtype)
        self.shift = (
            (-torch.tensor(mean, dtype=torch.float32) / std_t)
            .view(1, -1, 1, 1)
            .to(self.device, dtype)
        )

    def __call__(self, images: torch.Tensor, targets: torch.Tensor | None = None):
        if images.dtype != torch.uint8:
            raise TypeError(f"DeviceNormalize expects a uint8 batch, but got {images.dtype}.")
        x = images.to(self.device, non_blocking=True)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        x = torch.addcmul(self.shift, x.to(self.dtype), self.scale).contiguous(
            memory_format=memory_format
        )
        if targets is None:
            return x
        return x, targets.to(self.device, non_blocking=True)
