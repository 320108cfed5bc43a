"""Images from shard samples (WebDataset tar or Parquet): the decode `ImageFolderFast` does.

Use when: a `ShardSet` (`recipes.common.shards.shard_set`) holds encoded images (`"jpg"`, `"png"` or
other such fields) and labels (`"cls"`): `ShardSet.dataset(transform=ShardImages(224, train=True))`
yields `(uint8 [3, H, W], label)` as `ImageFolderFast` yields them from files: the same header read,
DCT-scaled or region decode of only the crop, eval geometry (`Resize(256)` + `CenterCrop(224)`
regions) or torchvision's random-resized crops and flips, and the same typed errors, naming the
sample's key.
Cost: per sample one header read, one decode of the crop's resolution, one antialiased resize.
Adapt here: `CROP_PCT`/`SCALE`/`RATIO`, `image_field`/`label_field`.
Trade-off: with `strict` every decode is checked (a shard sample has no per-file memory of an
earlier check, so a region decode reads to the image's bottom, about a whole decode); pass
`strict=False` to decode only the crop once the shards are known good. Random draws come from a
per-process generator seeded from torch's seed (`worker_init` gives each worker its own).
Copy with: vision/decoding/crop.py, vision/decoding/decode.py, vision/decoding/image_header.py,
  vision/decoding/jpeg_damage.py, vision/decoding/region_decode.py.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from recipes.vision.decoding.crop import CROP_PCT, RATIO, SCALE, eval_box, random_resized_box
from recipes.vision.decoding.decode import resize_uint8
from recipes.vision.decoding.image_header import ImageDecodeError, read_header
from recipes.vision.decoding.region_decode import decode_box, region_decode_available


class ShardImages:
    """`sample -> (uint8 [3, H, W], label)` for samples of image shards.

    Args:
        size: output side or (height, width).
        train: torchvision's `RandomResizedCrop` + `RandomHorizontalFlip`; else eval geometry.
        image_field: the sample's image field; None takes the first of jpg, jpeg, png, webp.
        label_field: the label field (an int), or None for `(image, sample)` with the rest.
        strict: check every decode for libjpeg's corrupt-data reports (`ImageDecodeError`).
        region_decode: as `ImageFolderFast`'s (None: when nvImageCodec is installed).

    Raises:
        ImageDecodeError: a sample without the image field, or a bad image, naming its key.
    """

    CROP_PCT = CROP_PCT
    SCALE = SCALE
    RATIO = RATIO
    IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        *,
        train: bool = False,
        image_field: str | None = None,
        label_field: str | None = "cls",
        strict: bool = True,
        region_decode: bool | None = None,
    ):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        if region_decode and not region_decode_available():
            raise ImportError(
                'region_decode=True needs nvImageCodec: pip install "loader-recipes[roi]".'
            )
        self.train = train
        self.image_field = image_field
        self.label_field = label_field
        self.strict = bool(strict)
        self.region_decode = region_decode
        self._checked = _NeverChecked()  # decode_box's per-file memory: none for shard samples
        self._rng: np.random.Generator | None = None
        self._rng_key: tuple[int, int] | None = None

    def __call__(self, sample: dict):
        key = sample.get("__key__", "<no key>")
        field = self.image_field or next((f for f in self.IMAGE_FIELDS if f in sample), None)
        if field is None or field not in sample:
            raise ImageDecodeError(
                f"sample {key!r} has no image field {field or list(self.IMAGE_FIELDS)} "
                f"(its fields: {sorted(k for k in sample if k != '__key__')}); pass image_field=."
            )
        data = bytes(sample[field])
        where = f"{key}.{field}"
        header = read_header(data, path=where)
        rng = self._generator()
        if self.train:
            box = random_resized_box(header.height, header.width, rng, self.SCALE, self.RATIO)
        else:
            box = eval_box(header.height, header.width, self.size, self.CROP_PCT)
        checked = None
        if self.strict:
            checked = self._checked
        pixels = decode_box(
            data,
            header,
            box,
            self.size,
            where,
            None,
            checked=checked,
            region_decode=self.region_decode,
        )
        image = resize_uint8(pixels, self.size)
        if self.train and rng.random() < 0.5:
            image = image.flip(-1)
        if self.label_field is None:
            return image, {k: v for k, v in sample.items() if k != field}
        if self.label_field not in sample:
            raise ImageDecodeError(
                f"sample {key!r} has no label field {self.label_field!r} (its fields: "
                f"{sorted(k for k in sample if k != '__key__')}); pass label_field=."
            )
        return image, int(sample[self.label_field])

    def _generator(self) -> np.random.Generator:
        key = (
            os.getpid(),
            torch.initial_seed(),
        )  # reseeded when torch is (ImageFolderFast._generator)
        if self._rng_key != key:
            self._rng = np.random.default_rng(key[1])
            self._rng_key = key
        return self._rng

    def __getstate__(self):
        return {**self.__dict__, "_rng": None, "_rng_key": None}


class _NeverChecked:
    """`decode_box`'s checked-files array for samples: nothing is ever marked checked."""

    def __getitem__(self, index) -> int:
        return 0

    def __setitem__(self, index, value) -> None:
        pass
