"""Vision recipes: ImageFolderFast, reduced-resolution decoding, decoded-image cache,
progressive resolution and device-side normalisation."""

from recipes.vision.decode import ImageDecodeError, dct_reduction, decode_image, read_header
from recipes.vision.device import IMAGENET_MEAN, IMAGENET_STD, DeviceNormalize, uint8_collate
from recipes.vision.device_crop import DeviceCropLoader
from recipes.vision.gpu_decode import GpuDecode, encoded_collate
from recipes.vision.image_cache import ImageCache, ImageCacheError, build_image_cache
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
