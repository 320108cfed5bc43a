"""Region decode: only a JPEG's crop, by libjpeg-turbo's cropped decode through nvImageCodec.

Use when: a crop keeps little of its JPEG and too much for a 1/2, 1/4 or 1/8 DCT-scaled decode
(`ImageFolderFast(region_decode=)`). With nvImageCodec installed (`pip install
"loader-recipes[roi]"`), a JPEG crop is decoded by libjpeg-turbo's cropped decode
(`jpeg_crop_scanline` + `jpeg_skip_scanlines`, nvImageCodec's CPU backend, no GPU needed): rows
below the crop are never read, and columns beside it skip the inverse DCT, upsampling and colour
conversion. The pixels are identical to a full decode followed by the crop.
Cost: rows above the crop are still entropy-decoded (a baseline JPEG has no random access), so
the saving grows with how little of the image a crop keeps: measured 1.14x train img/s per
worker on 500x375 photos. A strict decode reads the scan to its end (the rows below the crop
too, `recipes.vision.decoding.decode`): about the cost of a whole decode.
Adapt here: `_region_decoder` (one CPU thread per process and thread, sRGB, EXIF orientation
ignored). Trade-off: needs nvImageCodec; for CMYK/YCCK JPEGs, other codecs, or a file it declines,
`decode_region` returns None and the caller decodes the whole image.
Copy with: vision/decoding/crop.py, vision/decoding/decode.py, vision/decoding/image_header.py,
  vision/decoding/jpeg_damage.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from recipes.vision.decoding.crop import Box, scale_box
from recipes.vision.decoding.decode import dct_reduction, decode_image, turbo_available
from recipes.vision.decoding.image_header import ImageDecodeError, check_encoded
from recipes.vision.decoding.jpeg_damage import checked_by_libjpeg


def decode_region(
    data: bytes, box: Box, *, strict: bool = True, path: str = "<bytes>", index: int | None = None
) -> np.ndarray | None:
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
        if (
            strict
        ):  # whole rows (cropping columns costs nvImageCodec more than it saves) to the bottom
            region = stream.get_sub_code_stream(
                region=codec.Region(top, 0, stream.height, stream.width)
            )
        else:
            region = stream.get_sub_code_stream(
                region=codec.Region(top, left, top + height, left + width)
            )

        def run():
            image = dec.decode(region, params=params)
            if image is None:
                return None
            return np.asarray(image)  # the pixels are written by now

        if strict:
            pixels = checked_by_libjpeg(run, path=path, index=index)
        else:
            pixels = run()
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
    if pixels.shape != (height, width, 3):
        return None
    return pixels


def region_decode_available() -> bool:
    """Whether `decode_region` can decode here (nvImageCodec is importable)."""
    return _region_decoder() is not None


def _region_decoder():
    """(nvimgcodec module, CPU-only decoder, params) for this process, or None.

    nvImageCodec loads its codec extensions once, at import; a process that imports it here
    for CPU work (a DataLoader worker, or a machine without CUDA) loads only the libjpeg-turbo
    extension, so the GPU ones do not print load failures in every worker. A decoder's
    thread pool does not survive fork, so each process builds its own; and one decoder used by
    several threads at once fails ("Broken promise") or hangs, so each thread builds its own.
    """
    mine = getattr(_REGION, "decoder", None)
    if mine is not None and mine[0] == os.getpid():
        return mine[1]
    found = None
    try:
        codec = _import_nvimgcodec()
        dec = codec.Decoder(
            device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY,
            max_num_cpu_threads=1,
            backends=[codec.Backend(codec.BackendKind.CPU_ONLY)],
        )
        params = codec.DecodeParams(apply_exif_orientation=False, color_spec=codec.SRGB)
        found = (codec, dec, params)
    except (ImportError, RuntimeError, AttributeError):
        pass
    _REGION.decoder = (os.getpid(), found)
    return found


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


_REGION = threading.local()  # .decoder: (pid, (module, decoder, params) or None) of this thread


def decode_box(
    data: bytes,
    header,
    box: Box,
    out: tuple[int, int],
    path: str,
    index: int,
    *,
    checked: torch.Tensor | None,
    region_decode: bool | None,
) -> np.ndarray:
    """`ImageFolderFast._decode_box`: decodes the whole image at the coarsest DCT scale that
    keeps `box` at least `out`, then crops it; or, when no DCT scale applies, only `box` (region
    decode, unless `region_decode` is False). With `checked` (the dataset's shared uint8 flags per
    file: `strict`), a file's first decode is checked and marked in `checked`: a whole decode
    through TurboJPEG when it is installed (the check reads the whole scan anyway, and TurboJPEG
    reads it faster, the GIL released; cropped, the region decode's pixels), else a region decode
    that reads on to the image's bottom. A file's pixels do not depend on whether it was checked:
    a resumed epoch sees what the first one saw."""
    reduce = dct_reduction((box[2], box[3]), out)
    check = checked is not None and not checked[index]
    if reduce == 1 and region_decode is not False and header.format == "JPEG":
        check_encoded(data, header, path=path, index=index)
        if not (check and turbo_available()):  # else the check reads the whole scan anyway, and
            region = decode_region(data, box, strict=check, path=path, index=index)  # TurboJPEG
            if region is not None:  # reads it fastest (the GIL released); its crop is the region's
                if check:  # pixels
                    checked[index] = 1
                return region
    decoded = decode_image(data, reduce=reduce, header=header, path=path, index=index, strict=check)
    if check:
        checked[index] = 1
    h, w = decoded.shape[:2]
    if (h, w) != (header.height, header.width):
        box = scale_box(box, h / header.height, w / header.width, h, w)
    top, left, bh, bw = box
    return decoded[top : top + bh, left : left + bw]
