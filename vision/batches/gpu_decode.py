"""GPU JPEG decoding: workers read file bytes, the device decodes, crops and resizes whole batches.

Use when: CPU decoding cannot keep the GPU fed (on an H200 node, resnet50 bf16 takes 4,623
img/s and the best CPU path delivered 2,881 with 12 workers). As NVIDIA DALI's "mixed"
decoder: `ImageFolderFast(decode="gpu")` workers only read each file, check it as far as its
header allows, and draw its crop and flip from the seeded generator (so augmentation is as
reproducible as on the CPU); `encoded_collate` packs a batch's bytes into one tensor; and
`GpuDecode` decodes the batch with nvJPEG (`torchvision.io.decode_jpeg(list, device="cuda")`),
crops, resizes (antialiased bilinear), flips and normalises it on the device.
Cost: per image one file read in a worker; per batch one host-to-device copy of the encoded
bytes (~10x smaller than pixels), one batched decode and a crop-resize per image on the GPU.
Adapt here: `MEAN`/`STD`, `dtype`; `_fallback` for other codecs.
Trade-off: the GPU decodes whole images (no region-of-interest decode in torchvision); JPEGs
the device decoder rejects (CMYK, some progressive or arithmetic-coded files) and other
formats (PNG, ...) are decoded on the CPU in the main process, one by one, with the same
decoder and errors as the CPU path; a file the device decoder refuses and the CPU decoder
cannot decode either raises `ImageDecodeError` here (`on_error="skip"` covers what the workers
can check: unreadable, non-image, truncated, bombs). Damaged entropy data that the decoder
recovers from (libjpeg's "Corrupt JPEG data", which the CPU path's `strict` check turns into
an `ImageDecodeError`) is not detected on the device: torchvision's nvJPEG decode reports no
such warning, so those images are served as decoded. Check a dataset once with the CPU path
(e.g. `build_image_cache`, or an epoch with `on_error="skip"`) to find them.
Copy with: vision/batches/batch_buffers.py, vision/batches/device.py, vision/decoding/crop.py,
  vision/decoding/decode.py, vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from recipes.vision.batches.device import IMAGENET_MEAN, IMAGENET_STD, DeviceNormalize
from recipes.vision.decoding.crop import CropSettings, eval_box, random_resized_box
from recipes.vision.decoding.decode import decode_image
from recipes.vision.decoding.image_header import check_encoded


def encoded_item(
    data: bytes, header, crops: CropSettings, rng: np.random.Generator, *, path: str, index: int
) -> dict:
    """`ImageFolderFast(decode="gpu")`'s item (before its target): the file's bytes (checked as
    far as a header allows), its crop box in source pixels and its flip, drawn from `rng` as the
    CPU path draws them; what `encoded_collate` packs."""
    is_jpeg = check_encoded(data, header, path=path, index=index)
    flip = False
    if crops.train:
        box = random_resized_box(header.height, header.width, rng, crops.scale, crops.ratio)
        flip = bool(rng.random() < 0.5)
    else:
        box = eval_box(header.height, header.width, crops.size, crops.crop_pct)
    return {
        "data": torch.frombuffer(bytearray(data), dtype=torch.uint8),
        "box": torch.tensor(box, dtype=torch.int64),
        "flip": flip,
        "jpeg": is_jpeg,
        "index": index,
        "size": crops.size,
    }


def encoded_collate(batch: list[tuple[dict, int]]) -> dict[str, torch.Tensor]:
    """`ImageFolderFast(decode="gpu")` items into one batch: the files' bytes back to back
    (`data`, `offsets`), `boxes [B, 4]` (top, left, height, width in source pixels), `flips`,
    `jpeg`, `indices`, the output `size` and `targets`."""
    items, targets = zip(*batch, strict=True)
    offsets = torch.tensor(
        [0, *itertools.accumulate(len(item["data"]) for item in items)], dtype=torch.int64
    )
    return {
        "data": torch.cat([item["data"] for item in items]),
        "offsets": offsets,
        "boxes": torch.stack([item["box"] for item in items]),
        "flips": torch.tensor([item["flip"] for item in items]),
        "jpeg": torch.tensor([item["jpeg"] for item in items]),
        "indices": torch.tensor([item["index"] for item in items], dtype=torch.int64),
        "size": torch.tensor(items[0]["size"], dtype=torch.int64),
        "targets": torch.tensor(targets, dtype=torch.int64),
    }


class GpuDecode:
    """`encoded_collate` batches -> `(float [B, 3, H, W] normalised, channels_last; int64 [B])`
    on `device`.

    Args:
        dataset: the `ImageFolderFast(decode="gpu")` the batches come from (paths for errors
            and CPU fallbacks).
        device: where to decode; "cpu" runs the same steps with torchvision's CPU decoder.
        dtype: the output dtype (`torch.bfloat16` under bf16 autocast).

    Raises:
        RuntimeError: `device` is CUDA and CUDA is not available.

    Example:
        >>> ds = ImageFolderFast("/data/train", size=224, train=True, decode="gpu")
        >>> loader = make_loader(ds, batch_size=256, shuffle=True, collate_fn=encoded_collate)
        >>> to_images = GpuDecode(ds, device="cuda", dtype=torch.bfloat16)
        >>> for batch in loader:
        ...     images, targets = to_images(batch)
    """

    MEAN = IMAGENET_MEAN
    STD = IMAGENET_STD

    def __init__(
        self, dataset, *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.float32
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "GpuDecode: device='cuda' but CUDA is not available here; decode on the CPU "
                "instead (ImageFolderFast(decode='cpu'), the default, with make_loader)."
            )
        self.dataset = dataset
        self._normalize = DeviceNormalize(
            self.MEAN, self.STD, device=self.device, dtype=dtype, channels_last=True
        )

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = batch["offsets"].tolist()
        encoded = [batch["data"][offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        images = self.decode(encoded, batch["jpeg"].tolist(), batch["indices"].tolist())
        out = tuple(batch["size"].tolist())
        result = torch.empty((len(images), 3, *out), dtype=torch.float32, device=self.device)
        for row, (image, (top, left, h, w), flip) in enumerate(
            zip(images, batch["boxes"].tolist(), batch["flips"].tolist(), strict=True)
        ):
            crop = image[None, :, top : top + h, left : left + w].float()
            resized = torch.nn.functional.interpolate(
                crop, size=out, mode="bilinear", antialias=True, align_corners=False
            )[0]
            result[row] = resized.flip(-1) if flip else resized
        crops = (
            result.round_().clamp_(0, 255).to(torch.uint8)
        )  # the CPU path's uint8 crops, on the device
        return self._normalize(crops, batch["targets"])

    def decode(
        self, encoded: list[torch.Tensor], jpeg: list[bool], indices: list[int]
    ) -> list[torch.Tensor]:
        """`uint8 [3, H, W]` RGB images on the device: JPEGs in one batched device decode, the
        rest (and what the device decoder rejects) on the CPU."""
        from torchvision.io import ImageReadMode, decode_jpeg

        images: list[torch.Tensor | None] = [None] * len(encoded)
        wanted = [i for i, is_jpeg in enumerate(jpeg) if is_jpeg]
        if wanted:
            try:
                decoded = decode_jpeg(
                    [encoded[i] for i in wanted], mode=ImageReadMode.RGB, device=self.device
                )
            except RuntimeError:  # one bad apple fails the batch call: retry one by one
                decoded = [self._one(encoded[i]) for i in wanted]
            for i, image in zip(wanted, decoded, strict=True):
                images[i] = image
        for i, image in enumerate(images):
            if image is None:
                images[i] = self._fallback(encoded[i], indices[i])
        return images

    def _one(self, data: torch.Tensor) -> torch.Tensor | None:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            return None

    def _fallback(self, data: torch.Tensor, index: int) -> torch.Tensor:
        """The CPU path's decoder (same pixels, same `ImageDecodeError`)."""
        array = decode_image(
            data.numpy().tobytes(),
            path=self.dataset.paths[index],
            index=index,
            strict=getattr(self.dataset, "strict", True),
        )
        return torch.from_numpy(array).permute(2, 0, 1).to(self.device, non_blocking=True)
