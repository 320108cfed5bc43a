"""Region decode: only a JPEG's crop decoded (libjpeg-turbo through nvImageCodec's CPU
backend), against the full decode followed by the crop."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from recipes.testing import natural_image
from recipes.vision import ImageFolderFast, uint8_collate
from recipes.vision import folder_index as folder_index_module
from recipes.vision.decoding import region_decode as decode_module
from recipes.vision.decoding.decode import decode_image, turbo_available
from recipes.vision.decoding.region_decode import decode_region, region_decode_available

pytestmark = pytest.mark.skipif(
    not region_decode_available(), reason='needs nvImageCodec (pip install "loader-recipes[roi]")'
)

BOXES = [(0, 0, 300, 400), (37, 51, 200, 133), (250, 330, 50, 70), (1, 1, 1, 1), (5, 17, 295, 9)]


def _jpegs():
    rgb = Image.fromarray(natural_image(300, 400, np.random.default_rng(3))[..., ::-1].copy())
    exif = rgb.getexif()
    exif[0x0112] = 6  # rotated: ignored, as Pillow/torchvision ignore it

    def encode(image, **kw):
        buf = io.BytesIO()
        image.save(buf, "JPEG", **kw)
        return buf.getvalue()

    return {
        "4:2:0": encode(rgb, quality=90),
        "4:2:2": encode(rgb, quality=90, subsampling=1),
        "4:4:4": encode(rgb, quality=95, subsampling=0),
        "progressive": encode(rgb, quality=90, progressive=True),
        "restart markers": encode(rgb, quality=90, restart_marker_blocks=4),
        "gray": encode(rgb.convert("L"), quality=90),
        "exif rotated": encode(rgb, quality=90, exif=exif),
    }


@pytest.mark.parametrize("kind", sorted(_jpegs()))
def test_region_equals_full_decode_then_crop(kind):
    data = _jpegs()[kind]
    full = decode_image(data)
    for top, left, h, w in BOXES:
        region = decode_region(data, (top, left, h, w))
        assert region is not None and region.shape == (h, w, 3) and region.dtype == np.uint8, (
            kind,
            top,
            left,
        )
        np.testing.assert_array_equal(
            region, full[top : top + h, left : left + w], err_msg=f"{kind} {(top, left, h, w)}"
        )


def test_cmyk_and_other_formats_are_declined_for_the_full_decode():
    rgb = Image.fromarray(natural_image(64, 80, np.random.default_rng(4)))
    for fmt, image in (("JPEG", rgb.convert("CMYK")), ("PNG", rgb)):
        buf = io.BytesIO()
        image.save(buf, fmt)
        assert decode_region(buf.getvalue(), (0, 0, 8, 8)) is None, fmt


def test_train_crops_are_the_same_pixels_with_and_without_region_decode(image_tree, monkeypatch):
    calls = []
    real = decode_module.decode_region

    def spy(data, box, **kwargs):
        calls.append(box)
        return real(data, box, **kwargs)

    monkeypatch.setattr(
        decode_module, "decode_region", spy
    )  # where ImageFolderFast._decode_box looks it up
    for train in (True, False):  # at 256 px no crop of these photos allows a 1/2 DCT scale
        full = ImageFolderFast(image_tree, size=256, train=train, region_decode=False)
        region = ImageFolderFast(image_tree, size=256, train=train, region_decode=True)
        for epoch in range(
            2
        ):  # a file's first decode is checked (with TurboJPEG: a whole decode), then the crop's
            for i in range(len(full)):
                torch.manual_seed(epoch * 100 + i)
                a = full[i][0]
                torch.manual_seed(epoch * 100 + i)
                b = region[i][0]
                assert torch.equal(a, b), (train, epoch, i)
    # every JPEG went through the region decoder, from its second decode on with TurboJPEG
    assert len(calls) == (2 if turbo_available() else 4) * len(full)


def test_a_files_crop_is_the_same_on_its_first_checked_decode_and_later_ones(
    image_tree, monkeypatch
):
    """The first, strict decode of a file and the later ones may take different decoders; at
    every DCT scale (48 px crops of these photos allow 1/2, 1/4 and 1/8) they give the same
    pixels, so a resumed epoch, whose files are unchecked in a fresh process, sees what the
    first saw."""
    scales = []
    real = decode_module.decode_image

    def spy(data, **kwargs):
        scales.append(kwargs.get("reduce", 1))
        return real(data, **kwargs)

    monkeypatch.setattr(decode_module, "decode_image", spy)
    for seed in range(2):
        ds = ImageFolderFast(image_tree, size=48, train=True)  # every file unchecked
        for i in range(len(ds)):
            first = ds._output_image(i, np.random.default_rng([seed, i]))[
                0
            ]  # the strict first decode
            assert ds._checked[i]
            again = ds._output_image(i, np.random.default_rng([seed, i]))[
                0
            ]  # the same crop and flip
            assert torch.equal(again, first), (seed, i)
    assert {2, 4} <= set(scales), sorted(set(scales))


def test_forked_workers_decode_regions_after_the_parent_did(image_tree):
    ds = ImageFolderFast(image_tree, size=256, region_decode=True)
    ds[0]  # the parent built its decoder; the workers must build their own
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=uint8_collate)
    images = torch.cat([b[0] for b in loader])
    reference = ImageFolderFast(image_tree, size=256, region_decode=False)
    expected = torch.stack([reference[i][0] for i in range(len(reference))])
    assert torch.equal(images, expected)


def test_truncated_jpeg_still_raises_naming_the_file(own_tree):
    from recipes.vision import ImageDecodeError

    ds = ImageFolderFast(own_tree, size=128, region_decode=True)
    path = ds.samples[1][0]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ImageDecodeError, match="truncated") as error:
        ds[1]
    assert path in str(error.value)


def test_region_decode_true_without_nvimagecodec_says_how_to_install(image_tree, monkeypatch):
    monkeypatch.setattr(folder_index_module, "region_decode_available", lambda: False)
    with pytest.raises(ImportError, match=r"recipes\[roi\]"):
        ImageFolderFast(image_tree, region_decode=True)
    assert ImageFolderFast(image_tree).region_decode is None  # auto: no error
