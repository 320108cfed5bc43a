"""Decoding: encoded image bytes to uint8 RGB pixels on the CPU, and which pixels a crop needs.

Lives here: `image_header.py` (size and format without decoding; the checks that need no
decode), `decode.py` (OpenCV decode at a DCT-reduced scale, `resize_uint8`), `jpeg_damage.py`
(libjpeg's damage reports read back: `strict`), `region_decode.py` (only a JPEG's crop, through
nvImageCodec), `crop.py` (torchvision's crop geometry in source pixels, `CropSettings`) and
`bad_files.py` (the `on_error` policy for files that fail to decode).
May import: the standard library, numpy, torch, OpenCV/Pillow/nvImageCodec (inside functions)
and this room; never `cache/`, `batches/` or the datasets.
"""
