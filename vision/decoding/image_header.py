"""Image headers without decoding: size and format, bombs refused, truncated JPEGs found.

Use when: a decoder or a crop needs an image's size before its pixels (`read_header`), a file's
bytes and header in one read (`read_image_file`), or the checks that need no decode
(`check_encoded`: a JPEG with no end-of-image marker after its last scan is truncated).
Cost: a JPEG's or PNG's size is read from its frame marker or IHDR chunk (a few us, no pixel
decoded); other formats open with Pillow (~100 us), still without decoding pixels.
Adapt here: `read_header`'s size limit is Pillow's `Image.MAX_IMAGE_PIXELS` (a decompression
bomb is refused before any decode).
Trade-off: a JPEG whose frame marker follows its first scan, or any other oddity the direct
reader does not know, goes to Pillow: slower, never wrong.
Copy with: nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

_JPEG_SOS = b"\xff\xda"
_JPEG_EOI = b"\xff\xd9"


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
    jpeg = _jpeg_size(data)
    png = _png_size(data)
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
    for marker, pos in _jpeg_segments(data):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            if pos + 9 > len(data):
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            return (width, height) if width and height else None
        if marker == 0xDA:  # scan data before any frame header: let Pillow judge
            return None
    return None


def _jpeg_segments(data: bytes):
    """(marker, offset) of a JPEG's top-level marker segments from after SOI, up to and
    including the first scan's SOS (a thumbnail inside APP1 is skipped with its segment); stops
    early at anything that is not a marker or has a bad length."""
    pos = 2
    n = len(data)
    while pos + 4 <= n and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            pos += 2
            continue
        yield marker, pos
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA or length < 2:
            return
        pos += 2 + length


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, or None when `data` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR" or len(data) < 24:
        return None
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    return (width, height) if width and height else None


def _pillow_header(data: bytes, where: str) -> tuple[int, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size[0], image.size[1], image.format or "?"
    except Image.DecompressionBombError as error:
        raise ImageDecodeError(
            f"{where} is a decompression bomb ({error}); it was not decoded."
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageDecodeError(
            f"{where} is not a readable image ({type(error).__name__}: {error}); "
            "check the file, or pass on_error='skip'."
        ) from None


def check_encoded(
    data: bytes, header: ImageHeader, *, path: str = "<bytes>", index: int | None = None
) -> bool:
    """The checks that need no decode, beyond `read_header`'s; returns whether it is a JPEG.

    Raises:
        ImageDecodeError: a truncated JPEG (no end-of-image marker after the last scan).
    """
    is_jpeg = header.format in ("JPEG", "MPO")
    if is_jpeg and not _ends_with_eoi(data) and not _eoi_after_first_scan(data):
        raise ImageDecodeError(
            f"{_where(path, index)} is a truncated JPEG (no end-of-image marker after the last "
            "scan); re-download it, or pass on_error='skip'."
        )
    return is_jpeg


def _eoi_after_first_scan(data: bytes) -> bool:
    """Whether an end-of-image marker follows the image's first scan: entropy-coded data cannot
    hold one (0xFF is stuffed), so the first after it ends the image, and data after that (a
    Motion Photo's video, any trailer) is not the image's. The first scan is found by walking
    the marker segments (a thumbnail's scan lies inside its APP1 segment); where the walk
    fails, the last scan in the file counts."""
    for marker, pos in _jpeg_segments(data):
        if marker == 0xDA:
            return data.find(_JPEG_EOI, pos) != -1
    return data.rfind(_JPEG_EOI) > data.rfind(_JPEG_SOS)


def _ends_with_eoi(data: bytes) -> bool:
    """The common case of a complete JPEG: the end-of-image marker, maybe then zero padding."""
    return data[-2:] == _JPEG_EOI or data.rstrip(b"\x00")[-2:] == _JPEG_EOI


def _where(path: str, index: int | None) -> str:
    if index is None:
        return f"image {path!r}"
    return f"image {path!r} (index {index})"
