"""Image decoding with OpenCV at reduced resolution, strict about the JPEG damage libjpeg reports.

Use when: decoding JPEGs (or PNG, BMP, WebP, TIFF) into RGB uint8 arrays for training.
Cost: a header read (the JPEG frame marker, or Pillow for other formats; no pixel decoded)
and one `cv2.imdecode`. When the
output needs at most 1/2, 1/4 or 1/8 of the source's pixels per side, libjpeg-turbo decodes
at that scale in the DCT (`IMREAD_REDUCED_COLOR_*`), skipping most of the inverse DCT and
colour conversion: a 2000x1500 photo for a 224 crop decodes at 1/4 in about 1/6 of the time.
Adapt here: `decode_image(..., reduce=)`; `resize_uint8` for the interpolation.
Trade-off: the DCT scale is a power of two, so a 500x375 photo for a 224 crop (1.46x) decodes
at full size; a finer scale (3/4, 5/8) needs TurboJPEG directly (e.g. `simplejpeg`).

Crop boxes come from `recipes.vision.crop`, a crop-only JPEG decode from
`recipes.vision.region_decode`, uint8 batch buffers from `recipes.vision.batch_buffers`.

OpenCV's thread pool is not fork-safe: a parent that used cv2 with threads can hand forked
workers a pool lock that is never released (pytorch#1355, #45198). `decode_image` makes cv2
single-threaded in each DataLoader worker before its first decode there (as
`recipes.common.worker_init` does), so this file is safe on its own.

Damaged entropy data (`strict`, on by default): JPEG has no checksum. A flipped bit in the
scan can desynchronise the Huffman decoder; libjpeg-turbo recovers on its own (resyncs, pads
with zeros) and returns blocks of made-up pixels, reporting it only as a warning ("Corrupt
JPEG data: ...", "Premature end of JPEG file") that its default error manager prints to the
process's stderr. Neither OpenCV, nvImageCodec, Pillow nor torchvision exposes it, so a
strict decode points fd 2 at a private in-memory file for the call and reads it back: an
`ImageDecodeError` naming the file and libjpeg's message; other text goes on to the real
stderr. Cost: three syscalls (~3 us) per decode, within the noise of a 1 ms decode. A strict
region decode reads the scan to its end (the rows below the crop too), or damage there would
go unseen: about the cost of a whole decode, so `ImageFolderFast` checks each file once, on
its first decode, and region-decodes only the crop from then on.
What no decoder finds: damage that keeps the Huffman decoder in sync (a changed coefficient,
or a changed DC difference, which shifts every later block of that component). libjpeg
reported 29% of single-bit flips and 56% of triple flips in the scans of our 7 test kinds
(`tests/vision/test_decode.py`); some unreported ones are images several grey levels off on
average. Only a checksum of each file kept elsewhere catches those. Nor are JPEGs checked
that OpenCV refuses and Pillow then decodes (Pillow swallows the warning). Strict decodes of
one process take turns (fd 2 is per process): decode in processes (DataLoader workers), or
pass `strict=False` to decode in threads of one process.

Every mode comes out as 3-channel RGB: grayscale is replicated, alpha dropped, palettes
expanded, 16-bit scaled to 8-bit, CMYK converted. EXIF orientation is ignored, as
torchvision's `ImageFolder` (Pillow) ignores it, so both give the same pixels.
Copy with: nothing.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# IMREAD_REDUCED_* bits of cv2.imread flags, by DCT scale denominator.
_REDUCED_BITS = {1: 0, 2: 16, 4: 32, 8: 64}
_JPEG_SOS, _JPEG_EOI = b"\xff\xda", b"\xff\xd9"


class ImageDecodeError(ValueError):
    """An image file that cannot be decoded; the message names the file, index and cause."""


@dataclass(frozen=True)
class ImageHeader:
    width: int
    height: int
    format: str  # "JPEG", "PNG", ...


def read_header(data: bytes, *, path: str = "<bytes>", index: int | None = None) -> ImageHeader:
    """Reads an image's size and format without decoding pixels; rejects bombs and non-images.

    Raises:
        ImageDecodeError: empty or non-image bytes, or more pixels than Pillow's
            `Image.MAX_IMAGE_PIXELS` (a decompression bomb, never decoded).
    """
    where = _where(path, index)
    if not data:
        raise ImageDecodeError(f"{where} is empty (0 bytes); remove it or pass on_error='skip'.")
    jpeg, png = _jpeg_size(data), _png_size(data)
    if jpeg is not None:  # the common cases, read directly (Pillow's open costs ~100 us)
        width, height, fmt = *jpeg, "JPEG"
    elif png is not None:
        width, height, fmt = *png, "PNG"
    else:
        width, height, fmt = _pillow_header(data, where)
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise ImageDecodeError(
            f"{where} claims {width}x{height} = {width * height:,} pixels, over Pillow's "
            f"MAX_IMAGE_PIXELS ({limit:,}); a decompression bomb is never decoded."
        )
    return ImageHeader(width, height, fmt)


def read_image_file(path: str, *, index: int | None = None) -> tuple[bytes, ImageHeader]:
    """The bytes of the image file at `path` and its header (`read_header`): one read.

    Raises:
        ImageDecodeError: the file cannot be read, or `read_header` refuses it.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise ImageDecodeError(f"image {path!r} (index {index}) cannot be read: {error}") from None
    return data, read_header(data, path=path, index=index)


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's SOF marker, or None when `data` is not a plain JPEG."""
    if data[:2] != b"\xff\xd8":
        return None
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            if pos + 9 > n:
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            return (width, height) if width and height else None
        if marker == 0xDA or length < 2:  # scan data before any frame header: let Pillow judge
            return None
        pos += 2 + length
    return None


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, or None when `data` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR" or len(data) < 24:
        return None
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return (width, height) if width and height else None


def _pillow_header(data: bytes, where: str) -> tuple[int, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size[0], image.size[1], image.format or "?"
    except Image.DecompressionBombError as error:
        raise ImageDecodeError(f"{where} is a decompression bomb ({error}); it was not decoded.") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageDecodeError(
            f"{where} is not a readable image ({type(error).__name__}: {error}); "
            "check the file, or pass on_error='skip'."
        ) from None


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
    flags = (rgb if rgb is not None else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION
    if is_jpeg:
        flags |= _REDUCED_BITS[reduce]
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


def check_encoded(data: bytes, header: ImageHeader, *, path: str = "<bytes>", index: int | None = None) -> bool:
    """The checks that need no decode, beyond `read_header`'s; returns whether it is a JPEG.

    Raises:
        ImageDecodeError: a truncated JPEG (no end-of-image marker after the last scan).
    """
    is_jpeg = header.format in ("JPEG", "MPO")
    if is_jpeg and not _ends_with_eoi(data) and data.rfind(_JPEG_EOI) < data.rfind(_JPEG_SOS):
        raise ImageDecodeError(
            f"{_where(path, index)} is a truncated JPEG (no end-of-image marker after the last scan); "
            "re-download it, or pass on_error='skip'."
        )
    return is_jpeg


def _decode_with_pillow(data: bytes, path: str, index: int | None) -> np.ndarray:
    """Fallback for what OpenCV's codecs refuse; Pillow raises on truncation (LOAD_TRUNCATED_IMAGES off)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))
    except Exception as error:  # noqa: BLE001 - any codec failure is a bad file
        raise ImageDecodeError(
            f"{_where(path, index)} could not be decoded ({type(error).__name__}: {error}); "
            "check the file, or pass on_error='skip'."
        ) from None


def resize_uint8(image: np.ndarray, size: tuple[int, int], *, out: torch.Tensor | None = None,
                 mirror: bool = False) -> torch.Tensor:
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
        out.copy_(torch.nn.functional.interpolate(tensor, size=size, mode="bilinear", antialias=True))


def _ends_with_eoi(data: bytes) -> bool:
    """The common case of a complete JPEG: the end-of-image marker, maybe then zero padding."""
    return data[-2:] == _JPEG_EOI or data.rstrip(b"\x00")[-2:] == _JPEG_EOI


def _where(path: str, index: int | None) -> str:
    return f"image {path!r}" + (f" (index {index})" if index is not None else "")


# ---- libjpeg's warnings about damaged data (strict decoding) ---------------------------------
# What libjpeg(-turbo) prints for data it recovered from. Other warnings (an unknown JFIF
# revision, a bad ICC profile, which leave the pixels right) pass through to stderr.
_DAMAGE = ("Corrupt JPEG data", "Premature end of JPEG file", "Inconsistent progression sequence",
           "Invalid SOS parameters")
_HARMLESS = ("bad ICC marker",)


def checked_by_libjpeg(decode: Callable[[], object], *, path: str = "<bytes>", index: int | None = None):
    """`decode()`, with what libjpeg prints to stderr meanwhile read back: raises for damage.

    libjpeg's default error manager prints each warning (one line per decode) to fd 2. For
    the call, fd 2 points at this process's private in-memory file; afterwards the real fd 2
    is restored, the text read back, and lines that report damaged data raise, any other text
    is written on to the real stderr. One lock per process: fd 2 is shared by its threads.

    Raises:
        ImageDecodeError: libjpeg reported corrupt or missing entropy data.
    """
    with _STDERR.lock:
        sink = _STDERR.sink()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr at all: restore that afterwards
            saved = None
        os.dup2(sink, 2)
        try:
            result = decode()
        finally:
            if saved is None:
                os.close(2)
            else:
                os.dup2(saved, 2)
                os.close(saved)
            size = os.lseek(sink, 0, os.SEEK_CUR)  # fd 2 shared the sink's offset
            text = os.pread(sink, size, 0) if size else b""
            if size:
                os.ftruncate(sink, 0)
                os.lseek(sink, 0, os.SEEK_SET)
    if not text:
        return result
    lines = text.decode("utf-8", "replace").splitlines()
    damage = [line for line in lines if line.startswith(_DAMAGE) and not line.endswith(_HARMLESS)]
    others = "".join(f"{line}\n" for line in lines if line not in damage)
    if others and saved is not None:
        os.write(2, others.encode())
    if damage:
        raise ImageDecodeError(
            f"{_where(path, index)} has damaged JPEG data (libjpeg: {'; '.join(damage)}); the decoder would "
            "return made-up pixels. Re-download or remove it, pass on_error='skip', or strict=False to "
            "accept what the decoder recovers."
        )
    return result


class _StderrSink:
    """This process's in-memory file for libjpeg's messages, and the lock around its use."""

    def __init__(self):
        self.lock = threading.Lock()
        self._fd: int | None = None
        self._file = None

    def sink(self) -> int:
        if self._fd is None:
            if hasattr(os, "memfd_create"):
                self._fd = os.memfd_create("recipes-libjpeg-messages", os.MFD_CLOEXEC)
            else:
                self._file = tempfile.TemporaryFile()
                self._fd = self._file.fileno()
        return self._fd

    def after_fork_in_child(self) -> None:
        """A fresh sink and lock: the parent's file shares its offset with the parent."""
        if self._fd is not None and self._file is None:
            os.close(self._fd)
        self._fd, self._file = None, None
        self.lock = threading.Lock()


_STDERR = _StderrSink()
if hasattr(os, "register_at_fork"):  # no fork while a thread has fd 2 redirected (the child would inherit it)
    os.register_at_fork(before=lambda: _STDERR.lock.acquire(), after_in_parent=lambda: _STDERR.lock.release(),
                        after_in_child=_STDERR.after_fork_in_child)


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
