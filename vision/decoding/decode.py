"""Image decoding with OpenCV at reduced resolution, strict about the JPEG damage libjpeg reports.

Use when: decoding JPEGs (or PNG, BMP, WebP, TIFF) into RGB uint8 arrays for training.
Cost: a header read (the JPEG frame marker, or Pillow for other formats; no pixel decoded)
and one decode: a JPEG through TurboJPEG (`simplejpeg`, the GIL released, strict at no cost),
anything else, and a JPEG libjpeg warns about (decoded twice), through `cv2.imdecode`. When the
output needs at most 1/2, 1/4 or 1/8 of the source's pixels per side, libjpeg-turbo decodes
at that scale in the DCT (`IMREAD_REDUCED_COLOR_*`), skipping most of the inverse DCT and
colour conversion: a 2000x1500 photo for a 224 crop decodes at 1/4 in about 1/6 of the time.
Adapt here: `decode_image(..., reduce=)`; `resize_uint8` for the interpolation.
Trade-off: the DCT scale is a power of two, so a 500x375 photo for a 224 crop (1.46x) decodes
at full size (TurboJPEG's finer scales, 3/4 or 5/8, would move the pixels further from
torchvision's). Without `simplejpeg` every decode goes through OpenCV, and strict ones take
turns in a process (`jpeg_damage.py`).

Headers come from `recipes.vision.decoding.image_header`, the strict check of libjpeg's
damage reports (`strict`, on by default) from `recipes.vision.decoding.jpeg_damage`, crop
boxes from `recipes.vision.decoding.crop`, a crop-only JPEG decode from
`recipes.vision.decoding.region_decode`, uint8 batch buffers from
`recipes.vision.batches.batch_buffers`.

OpenCV's thread pool is not fork-safe: a parent that used cv2 with threads can hand forked
workers a pool lock that is never released (pytorch#1355, #45198). `decode_image` makes cv2
single-threaded in each DataLoader worker before its first decode there (as
`recipes.common.worker_init` does), so this file is safe on its own.

Every mode comes out as 3-channel RGB: grayscale is replicated, alpha dropped, palettes
expanded, 16-bit scaled to 8-bit, CMYK converted. EXIF orientation is ignored, as
torchvision's `ImageFolder` (Pillow) ignores it, so both give the same pixels.
Copy with: vision/decoding/image_header.py, vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch

from recipes.vision.decoding.image_header import (
    ImageDecodeError,
    ImageHeader,
    _where,
    check_encoded,
    read_header,
)
from recipes.vision.decoding.jpeg_damage import checked_by_libjpeg

# IMREAD_REDUCED_* bits of cv2.imread flags, by DCT scale denominator.
_REDUCED_BITS = {1: 0, 2: 16, 4: 32, 8: 64}


def dct_reduction(region: tuple[float, float], output: tuple[int, int]) -> int:
    """The largest DCT scale denominator (1, 2, 4 or 8) that keeps `region` >= `output`.

    Args:
        region: (height, width) of the source region the output is made from.
        output: (height, width) of the output.
    """
    ratio = min(region[0] / output[0], region[1] / output[1])
    for k in (8, 4, 2):
        if ratio >= k:
            return k
    return 1


def decode_image(
    data: bytes,
    *,
    reduce: int = 1,
    header: ImageHeader | None = None,
    path: str = "<bytes>",
    index: int | None = None,
    strict: bool = True,
) -> np.ndarray:
    """Decodes to an RGB uint8 array `[H, W, 3]`, at 1/`reduce` scale for JPEGs.

    Args:
        data: the encoded file.
        reduce: DCT scale denominator, 1, 2, 4 or 8 (used for JPEG; others decode at full size).
        header: the result of `read_header`, when already read.
        path, index: for error messages.
        strict: raise for damaged JPEG entropy data that libjpeg-turbo reports and recovers
            from (see the module docstring); False returns what the decoder recovered.

    Raises:
        ImageDecodeError: truncated, empty or non-image data, a decompression bomb, data the
            decoders refuse, or (with `strict`) damaged entropy data that libjpeg reports.
    """
    cv2 = _opencv()
    if reduce not in _REDUCED_BITS:
        raise ValueError(f"`reduce` must be one of 1, 2, 4, 8, but is {reduce!r} instead.")
    header = header or read_header(data, path=path, index=index)
    is_jpeg = check_encoded(data, header, path=path, index=index)
    rgb = getattr(cv2, "IMREAD_COLOR_RGB", None)
    color = rgb
    if rgb is None:
        color = cv2.IMREAD_COLOR
    flags = color | cv2.IMREAD_IGNORE_ORIENTATION
    if is_jpeg:
        flags |= _REDUCED_BITS[reduce]
    if is_jpeg:
        image = _turbo_decode(data, header, reduce)
        if image is not None:
            return image
    buffer = np.frombuffer(data, np.uint8)
    if is_jpeg and strict:
        image = checked_by_libjpeg(lambda: cv2.imdecode(buffer, flags), path=path, index=index)
    else:
        image = cv2.imdecode(buffer, flags)
    if image is None:
        return _decode_with_pillow(data, path, index)
    if rgb is None:
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    return image


def _turbo_decode(data: bytes, header: ImageHeader, reduce: int) -> np.ndarray | None:
    """A JPEG decoded by TurboJPEG through `simplejpeg`, the GIL released and no lock taken:
    the same libjpeg-turbo decode as OpenCV's (accurate DCT, smooth upsampling, the same DCT
    scale; CMYK and YCCK converted by the same formula), so the same pixels. Always asked to
    be strict: a file with any warning (TurboJPEG reports it after the decode) returns None,
    and the caller decodes it again through OpenCV, which keeps the old path's behaviour for
    it (with `strict`, `checked_by_libjpeg` tells damage from a harmless warning; without, what
    OpenCV or Pillow make of it). None too when `simplejpeg` is not installed."""
    if _SIMPLEJPEG is False:
        return None
    try:
        return _SIMPLEJPEG.decode_jpeg(
            data,
            colorspace="RGB",
            min_height=-(-header.height // reduce),
            min_width=-(-header.width // reduce),
            min_factor=reduce,
            strict=True,
        )
    except (ValueError, OSError):
        return None


def turbo_available() -> bool:
    """Whether JPEGs decode through TurboJPEG (`simplejpeg` installed)."""
    return _SIMPLEJPEG is not False


def _load_simplejpeg():
    try:
        import simplejpeg
    except ImportError:
        return False
    return simplejpeg


_SIMPLEJPEG = _load_simplejpeg()


def _decode_with_pillow(data: bytes, path: str, index: int | None) -> np.ndarray:
    """Fallback for what OpenCV's codecs refuse; Pillow raises on truncation (LOAD_TRUNCATED_IMAGES
    off)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))
    except Exception as error:  # noqa: BLE001 - any codec failure is a bad file
        raise ImageDecodeError(
            f"{_where(path, index)} could not be decoded ({type(error).__name__}: {error}); "
            "check the file, or pass on_error='skip'."
        ) from None


def resize_uint8(
    image: np.ndarray,
    size: tuple[int, int],
    *,
    out: torch.Tensor | None = None,
    mirror: bool = False,
) -> torch.Tensor:
    """Antialiased bilinear resize of an `[H, W, 3]` uint8 array to a `[3, h, w]` uint8 tensor,
    channels-last in memory: written into `out` when given (a row of a channels-last batch),
    else into a new tensor; a view of `image` when no resize is needed and no `out` is given.
    With `mirror`, flipped left to right: resized apart, then mirrored into `out` by OpenCV
    (the GIL released).

    The same filter as Pillow's and torchvision's `Resize(antialias=True)`. torch's uint8
    kernel reads channels-last input; asked for channels-last output (its `out=`) it also
    skips its planar output's transpose: 0.16 ms at 388 -> 224 px against 0.26 ms, and 0.29
    ms with the copy into a channels-last batch row that planar output then needs (one
    thread, 2-core Xeon). Pillow takes 0.78 ms.
    """
    if mirror:
        resized = resize_uint8(image, size)
        if out is None:
            out = torch.empty((size[0], size[1], 3), dtype=torch.uint8).permute(2, 0, 1)
        if out.permute(1, 2, 0).is_contiguous():
            _opencv().flip(resized.permute(1, 2, 0).numpy(), 1, dst=out.permute(1, 2, 0).numpy())
            return out
        return out.copy_(resized.flip(-1))
    tensor = torch.from_numpy(image).permute(2, 0, 1)
    if tuple(tensor.shape[1:]) == tuple(size):
        if out is None:
            return tensor  # a view; collate copies it into the batch
        return out.copy_(tensor)
    if out is None:
        out = torch.empty((size[0], size[1], 3), dtype=torch.uint8).permute(2, 0, 1)
    _resize_aa(tensor[None], tuple(size), out[None])
    return out


def _resize_aa(tensor: torch.Tensor, size: tuple[int, int], out: torch.Tensor) -> None:
    """`interpolate(tensor, size, mode="bilinear", antialias=True)` written into `out` (its
    layout kept), through the op's `out=` variant; `interpolate` and a copy where a torch
    build lacks it."""
    try:
        torch._C._nn._upsample_bilinear2d_aa(tensor, size, False, out=out)
    except (AttributeError, TypeError, RuntimeError):
        out.copy_(
            torch.nn.functional.interpolate(tensor, size=size, mode="bilinear", antialias=True)
        )


def _opencv():
    """cv2, single-threaded and without OpenCL in a DataLoader worker (once per process)."""
    global _CV2_PID
    import cv2

    if _CV2_PID != os.getpid():
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            cv2.setNumThreads(0)
            cv2.ocl.setUseOpenCL(False)
        _CV2_PID = os.getpid()
    return cv2


_CV2_PID: int | None = None
