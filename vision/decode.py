"""Image decoding with OpenCV at reduced resolution, crop geometry, and uint8 output buffers.

Use when: decoding JPEGs (or PNG, BMP, WebP, TIFF) into RGB uint8 arrays for training.
Cost: a header read (the JPEG frame marker, or Pillow for other formats; no pixel decoded)
and one `cv2.imdecode`. When the
output needs at most 1/2, 1/4 or 1/8 of the source's pixels per side, libjpeg-turbo decodes
at that scale in the DCT (`IMREAD_REDUCED_COLOR_*`), skipping most of the inverse DCT and
colour conversion: a 2000x1500 photo for a 224 crop decodes at 1/4 in about 1/6 of the time.
Adapt here: `decode_image(..., reduce=)`; `resize_uint8` for the interpolation.
Trade-off: the DCT scale is a power of two, so a 500x375 photo for a 224 crop (1.46x) decodes
at full size; a finer scale (3/4, 5/8) needs TurboJPEG directly (e.g. `simplejpeg`).

Region decode (`decode_region`): with nvImageCodec installed (`pip install "recipes[roi]"`),
a JPEG crop is decoded by libjpeg-turbo's cropped decode (`jpeg_crop_scanline` +
`jpeg_skip_scanlines`, nvImageCodec's CPU backend, no GPU needed): rows below the crop are
never read, and columns beside it skip the inverse DCT, upsampling and colour conversion. The
pixels are identical to a full decode followed by the crop. Rows above the crop are still
entropy-decoded (a baseline JPEG has no random access), so the saving grows with how little
of the image a crop keeps: measured 1.14x train img/s per worker on 500x375 photos.

Crop geometry (torchvision's eval resize-and-centre-crop and random-resized-crop, in source
pixels) says which pixels an output needs before decoding, so the decoder skips the rest
and the resize touches only the crop. It differs from torchvision's resize-then-crop only at
the crop border and by rounding the box to whole pixels: under 2 grey levels of mean
difference on photos.

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
"""

from __future__ import annotations

import io
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


def resize_uint8(image: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of an `[H, W, 3]` uint8 array to a `[3, h, w]` uint8 tensor
    (channels-last in memory; a view of `image` when no resize is needed).

    The same filter as Pillow's and torchvision's `Resize(antialias=True)`; torch's uint8
    kernel for channels-last input is several times faster than Pillow's.
    """
    tensor = torch.from_numpy(image).permute(2, 0, 1)
    if tuple(tensor.shape[1:]) == tuple(size):
        return tensor  # a view; collate copies it into the batch
    out = torch.nn.functional.interpolate(tensor[None], size=size, mode="bilinear", antialias=True)
    return out[0]


def _ends_with_eoi(data: bytes) -> bool:
    """The common case of a complete JPEG: the end-of-image marker, maybe then zero padding."""
    return data[-2:] == _JPEG_EOI or data.rstrip(b"\x00")[-2:] == _JPEG_EOI


def _where(path: str, index: int | None) -> str:
    return f"image {path!r}" + (f" (index {index})" if index is not None else "")


def decode_region(data: bytes, box: Box, *, strict: bool = True, path: str = "<bytes>",
                  index: int | None = None) -> np.ndarray | None:
    """The RGB uint8 pixels `[h, w, 3]` of `box` (top, left, height, width) of a JPEG, decoded
    alone (libjpeg-turbo's cropped decode through nvImageCodec's CPU backend).

    With `strict`, whole rows from the crop's top down to the image's bottom are decoded, so
    that libjpeg reads the whole scan and reports damage anywhere in it, as a full decode
    does (about the cost of a full decode); the crop is returned.

    Returns None when nvImageCodec is not installed or declines the file (the caller then
    decodes the whole image, whose checks and errors apply); the pixels are those of a full
    decode with EXIF orientation ignored, cropped.

    Raises:
        ImageDecodeError: with `strict`, damaged entropy data that libjpeg reported.
    """
    decoder = _region_decoder()
    if decoder is None:
        return None
    codec, dec, params = decoder
    top, left, height, width = box
    try:
        stream = codec.CodeStream(data)
        if stream.codec_name != "jpeg" or stream.num_channels not in (1, 3):
            return None  # CMYK/YCCK and other codecs: the full decode converts them as OpenCV does
        if strict:  # whole rows (cropping columns costs nvImageCodec more than it saves) to the bottom
            region = stream.get_sub_code_stream(region=codec.Region(top, 0, stream.height, stream.width))
        else:
            region = stream.get_sub_code_stream(region=codec.Region(top, left, top + height, left + width))

        def run():
            image = dec.decode(region, params=params)
            return None if image is None else np.asarray(image)  # the pixels are written by now

        pixels = checked_by_libjpeg(run, path=path, index=index) if strict else run()
    except ImageDecodeError:
        raise
    except (RuntimeError, ValueError):
        return None
    if pixels is None:
        return None
    if pixels.ndim == 2 or pixels.shape[2] == 1:
        pixels = pixels.reshape(*pixels.shape[:2], 1)
    if strict:
        pixels = pixels[:height, left : left + width]
    if pixels.shape[2] == 1:
        pixels = np.repeat(pixels, 3, axis=2)
    return pixels if pixels.shape == (height, width, 3) else None


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


def region_decode_available() -> bool:
    """Whether `decode_region` can decode here (nvImageCodec is importable)."""
    return _region_decoder() is not None


def _region_decoder():
    """(nvimgcodec module, CPU-only decoder, params) for this process, or None.

    nvImageCodec loads its codec extensions once, at import; a process that imports it here
    for CPU work (a DataLoader worker, or a machine without CUDA) loads only the libjpeg-turbo
    extension, so the GPU ones do not print load failures in every worker. A decoder's
    thread pool does not survive fork, so each process builds its own.
    """
    global _REGION, _REGION_PID
    if _REGION_PID == os.getpid():
        return _REGION
    _REGION_PID, _REGION = os.getpid(), None
    try:
        codec = _import_nvimgcodec()
        dec = codec.Decoder(device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                            backends=[codec.Backend(codec.BackendKind.CPU_ONLY)])
        params = codec.DecodeParams(apply_exif_orientation=False, color_spec=codec.SRGB)
    except (ImportError, RuntimeError, AttributeError):
        return None
    _REGION = (codec, dec, params)
    return _REGION


def _import_nvimgcodec():
    import sys

    if "nvidia.nvimgcodec" in sys.modules:
        return sys.modules["nvidia.nvimgcodec"]
    import importlib.util

    spec = importlib.util.find_spec("nvidia.nvimgcodec")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nvidia-nvimgcodec is not installed")
    from torch.utils.data import get_worker_info

    if get_worker_info() is None and torch.cuda.is_available():
        import nvidia.nvimgcodec as codec  # the user's GPU decoders stay available in this process

        return codec
    extension = Path(spec.submodule_search_locations[0]) / "extensions"
    turbo = sorted(extension.glob("libjpeg_turbo_ext.so*"))
    if not turbo:
        raise ImportError("nvidia-nvimgcodec has no libjpeg-turbo extension")
    only = Path(tempfile.gettempdir()) / f"recipes-nvimgcodec-{os.getuid()}-{turbo[0].name}"
    if not (only / turbo[0].name).exists():
        staging = Path(tempfile.mkdtemp(prefix=only.name + ".", dir=only.parent))
        (staging / turbo[0].name).symlink_to(turbo[0])
        try:
            os.replace(staging, only)
        except OSError:  # another process made it first
            shutil.rmtree(staging, ignore_errors=True)
    saved = {k: os.environ.get(k) for k in ("NVIMGCODEC_EXTENSIONS_PATH", "PYNVIMGCODEC_VERBOSITY")}
    os.environ.update(NVIMGCODEC_EXTENSIONS_PATH=str(only), PYNVIMGCODEC_VERBOSITY="0")
    try:
        import nvidia.nvimgcodec as codec
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return codec


_REGION = None
_REGION_PID: int | None = None


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


# ---- crop geometry, in source pixels ------------------------------------------------------
CROP_PCT = 0.875  # Resize(256) + CenterCrop(224)
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)

Box = tuple[int, int, int, int]  # top, left, height, width


def resize_side(size: tuple[int, int], crop_pct: float = CROP_PCT) -> int:
    """The shorter-side target of the eval resize: `floor(max(size) / crop_pct)` (224 -> 256)."""
    return int(math.floor(max(size) / crop_pct + 1e-9))


def eval_box(height: int, width: int, size: tuple[int, int], crop_pct: float = CROP_PCT) -> Box:
    """The source box that torchvision's `Resize(side) + CenterCrop(size)` keeps.

    Resize maps the shorter side to `side` and the longer to `int(side * long / short)`;
    CenterCrop then takes `size` at `round((resized - size) / 2)`. Mapped back to source pixels.
    """
    side = resize_side(size, crop_pct)
    new_h, new_w = _resized(height, width, side)
    sy, sx = height / new_h, width / new_w
    top = int(round((new_h - size[0]) / 2.0))
    left = int(round((new_w - size[1]) / 2.0))
    return _clip_box(top * sy, left * sx, size[0] * sy, size[1] * sx, height, width)


def _resized(height: int, width: int, side: int) -> tuple[int, int]:
    """torchvision's `Resize(side)` output size: shorter side to `side`, longer truncated."""
    if height <= width:
        return side, int(side * width / height)
    return int(side * height / width), side


def random_resized_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = SCALE,
    ratio: tuple[float, float] = RATIO,
) -> Box:
    """torchvision's `RandomResizedCrop.get_params`, drawn from a NumPy generator."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height  # fallback: the central crop with the ratio clamped
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def scale_box(box: Box, sy: float, sx: float, height: int, width: int) -> Box:
    """`box` mapped onto an image scaled by (sy, sx), e.g. a DCT-reduced decode."""
    top, left, h, w = box
    return _clip_box(top * sy, left * sx, h * sy, w * sx, height, width)


def _clip_box(top: float, left: float, h: float, w: float, height: int, width: int) -> Box:
    t, lft = int(round(top)), int(round(left))
    b, r = int(round(top + h)), int(round(left + w))
    t, lft = min(max(t, 0), height - 1), min(max(lft, 0), width - 1)
    b, r = min(max(b, t + 1), height), min(max(r, lft + 1), width)
    return t, lft, b - t, r - lft


# ---- output buffers and worker memory -----------------------------------------------------
def new_uint8_batch(batch_size: int, channels: int, height: int, width: int, *,
                    channels_last: bool = True) -> torch.Tensor:
    """An empty `uint8 [B, C, H, W]` batch (channels_last in memory by default), in shared
    memory inside a DataLoader worker (so it crosses to the main process without a copy)."""
    from torch.utils.data import get_worker_info

    numel = batch_size * channels * height * width
    if get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(numel, device="cpu")
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        flat = torch.empty(numel, dtype=torch.uint8)
    if not channels_last:
        return flat.view(batch_size, channels, height, width)
    return flat.view(batch_size, height, width, channels).permute(0, 3, 1, 2)


def copy_image(dst: torch.Tensor, image: torch.Tensor) -> None:
    """`dst.copy_(image)` for uint8 `[3, H, W]` tensors. When `dst` is channels-last in memory
    (a row of `new_uint8_batch`) and `image` is planar (what `resize_uint8` returns), OpenCV's
    channel merge writes it about 10x faster than torch's transposing copy (0.01 against
    0.14 ms at 224 px)."""
    if (image.is_contiguous() and dst.stride() == (1, dst.shape[2] * 3, 3) and image.shape == dst.shape
            and image.dtype == dst.dtype == torch.uint8 and image.device.type == dst.device.type == "cpu"):
        cv2 = _opencv()
        cv2.merge([image[c].numpy() for c in range(3)], dst.permute(1, 2, 0).numpy())
    else:
        dst.copy_(image)


def trim_heap() -> None:
    """Returns the free pages inside this process's heap to the system (glibc `malloc_trim`).

    Call it once per batch of decodes: glibc reuses the heap for such mid-sized buffers
    instead of `mmap`ing them (page faults are costly), but the heap fragments between
    long-lived objects and never shrinks by itself, so worker memory creeps up epoch after
    epoch (issue #10). A trim per batch costs ~0.1 ms.
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import platform

        _LIBC = ctypes.CDLL("libc.so.6") if platform.libc_ver()[0] == "glibc" else False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None
