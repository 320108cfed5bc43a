"""Vision recipes: ImageFolderFast, reduced-resolution decoding, decoded-image cache,
progressive resolution and device-side normalisation."""

from recipes.vision.batches.device import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DeviceNormalize,
    uint8_collate,
)
from recipes.vision.batches.device_crop import DeviceCropLoader
from recipes.vision.batches.gpu_decode import GpuDecode, encoded_collate
from recipes.vision.cache.image_cache import ImageCache, ImageCacheError
from recipes.vision.cache.image_cache_build import build_image_cache
from recipes.vision.decoding.decode import dct_reduction, decode_image
from recipes.vision.decoding.image_header import ImageDecodeError, read_header
from recipes.vision.image_folder import ImageFolderFast
from recipes.vision.progressive import ProgressiveResolution
from recipes.vision.shard_images import ShardImages

__all__ = [
    "DeviceCropLoader",
    "DeviceNormalize",
    "GpuDecode",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageCache",
    "ImageCacheError",
    "ImageDecodeError",
    "ImageFolderFast",
    "ProgressiveResolution",
    "ShardImages",
    "build_image_cache",
    "dct_reduction",
    "decode_image",
    "encoded_collate",
    "read_header",
    "uint8_collate",
]
