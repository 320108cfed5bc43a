"""Strict JPEG decoding: libjpeg-turbo's warnings about damaged data, read back and raised.

Use when: a decode must not return made-up pixels (`decode_image(..., strict=True)`, the
default, and region decodes). `checked_by_libjpeg(decode)` runs a decode with fd 2 pointed at
this process's private in-memory file and raises `ImageDecodeError` for what libjpeg reports.
Cost: three syscalls (~3 us) per decode; strict decodes of one process take turns (a lock).
Adapt here: `_DAMAGE` and `_HARMLESS`, which of libjpeg's messages mean made-up pixels.
Trade-off: only what libjpeg notices (below). Used only where TurboJPEG (`simplejpeg`, strict
without fd 2 and without a lock) declines a file or is not installed.

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
(`tests/vision/decoding/test_decode.py`); some unreported ones are images several grey levels off on
average. Only a checksum of each file kept elsewhere catches those. Nor are JPEGs checked
that OpenCV refuses and Pillow then decodes (Pillow swallows the warning). Strict decodes
through this file take turns in a process (fd 2 is per process); with TurboJPEG installed (a
dependency) they are only the files it warns about, so threads decode strictly in parallel.
Copy with: vision/decoding/image_header.py.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable

from recipes.vision.decoding.image_header import ImageDecodeError, _where

# ---- libjpeg's warnings about damaged data (strict decoding) ---------------------------------
# What libjpeg(-turbo) prints for data it recovered from. Other warnings (an unknown JFIF
# revision, a bad ICC profile, which leave the pixels right) pass through to stderr.
_DAMAGE = (
    "Corrupt JPEG data",
    "Premature end of JPEG file",
    "Inconsistent progression sequence",
    "Invalid SOS parameters",
)
_HARMLESS = ("bad ICC marker",)


def checked_by_libjpeg(
    decode: Callable[[], object], *, path: str = "<bytes>", index: int | None = None
):
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
            f"{_where(path, index)} has damaged JPEG data (libjpeg: {'; '.join(damage)}); the "
            "decoder would return made-up pixels. Re-download or remove it, pass on_error='skip', "
            "or strict=False to accept what the decoder recovers."
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
        self._fd = None
        self._file = None
        self.lock = threading.Lock()


_STDERR = _StderrSink()
if hasattr(
    os, "register_at_fork"
):  # no fork while a thread has fd 2 redirected (the child would inherit it)
    os.register_at_fork(
        before=lambda: _STDERR.lock.acquire(),
        after_in_parent=lambda: _STDERR.lock.release(),
        after_in_child=_STDERR.after_fork_in_child,
    )
