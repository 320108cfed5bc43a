import io
import pickle
import struct
import zlib

import cv2
import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

from recipes.common import PackedStrings, worker_init
from recipes.vision import ImageDecodeError, ImageFolderFast, uint8_collate
from recipes.vision.decoding import (
    region_decode as decode_box_module,  # ImageFolderFast._decode_box's decoders
)


def _tv_eval(size):
    return T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.PILToTensor()])


def _mad(a, b):
    return (a.int() - b.int()).abs().float().mean().item()


# ---- indexing: torchvision's ImageFolder exactly -------------------------------------------
def test_index_equals_torchvision(image_tree):
    ours = ImageFolderFast(image_tree)
    ref = torchvision.datasets.ImageFolder(image_tree)
    assert ours.classes == ref.classes and ours.class_to_idx == ref.class_to_idx
    assert ours.samples == ref.samples and ours.imgs == ref.imgs
    assert ours.targets.tolist() == ref.targets
    assert isinstance(ours.paths, PackedStrings) and isinstance(ours.targets, np.ndarray)
    assert len(ours) == len(ref) == 12


def test_extensions_and_is_valid_file_like_torchvision(tmp_path):
    for cls in ("b", "a"):
        (tmp_path / cls).mkdir()
        for name in ("x.jpg", "y.PNG", "z.txt", "w.jpeg"):
            cv2.imwrite(
                str(tmp_path / cls / name), np.zeros((4, 4, 3), np.uint8)
            ) if not name.endswith(".txt") else (tmp_path / cls / name).write_text("no")
    for kwargs in ({}, {"extensions": (".png",)}, {"is_valid_file": lambda p: p.endswith("x.jpg")}):
        ours = ImageFolderFast(tmp_path, **kwargs)
        ref = (
            torchvision.datasets.ImageFolder(tmp_path, **kwargs)
            if kwargs.get("extensions") is None
            else torchvision.datasets.DatasetFolder(tmp_path, loader=None, **kwargs)
        )
        assert ours.samples == ref.samples, kwargs


def test_find_classes_hook_is_honoured(image_tree):
    class OnlyFirst(ImageFolderFast):
        def find_classes(self, directory):
            return ["class_00"], {"class_00": 7}

    ds = OnlyFirst(image_tree)
    assert ds.classes == ["class_00"] and set(ds.targets.tolist()) == {7} and len(ds) == 4


@pytest.mark.parametrize("make", ["no_classes", "no_files"])
def test_empty_tree_raises_torchvisions_error(tmp_path, make):
    if make == "no_files":
        (tmp_path / "cls").mkdir()
        (tmp_path / "cls" / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError) as ref:
        torchvision.datasets.ImageFolder(tmp_path)
    with pytest.raises(FileNotFoundError) as ours:
        ImageFolderFast(tmp_path)
    assert str(ours.value) == str(ref.value)


# ---- pixels: eval matches torchvision's Resize + CenterCrop + PILToTensor --------------------
@pytest.mark.parametrize("size", [224, 160, 96])
def test_eval_matches_torchvision_pipeline(image_tree, size):
    """A few grey levels apart. At 160 and 96 the JPEG is decoded at 1/2 DCT scale, whose
    low-pass is sharper than Pillow's antialias filter; on textured regions that adds 1-2
    levels over the full-scale decode."""
    ours = ImageFolderFast(image_tree, size=size)
    ref = torchvision.datasets.ImageFolder(image_tree, transform=_tv_eval(size))
    mads = []
    for i in range(len(ours)):
        image, target = ours[i]
        expected, expected_target = ref[i]
        assert image.dtype == torch.uint8 and image.shape == (3, size, size)
        assert target == expected_target
        mads.append(_mad(image, expected))
    assert max(mads) < 5.0 and np.mean(mads) < 4.0, mads


def test_non_square_size(image_tree):
    image, _ = ImageFolderFast(image_tree, size=(128, 192))[0]
    assert image.shape == (3, 128, 192)


def test_invalid_arguments(image_tree):
    with pytest.raises(ValueError, match="`size` must be a positive int"):
        ImageFolderFast(image_tree, size=0)
    with pytest.raises(
        ValueError, match="`on_error` must be 'raise' or 'skip', but is 'ignore' instead."
    ):
        ImageFolderFast(image_tree, on_error="ignore")
    with pytest.raises(IndexError, match="out of range"):
        ImageFolderFast(image_tree)[99]


# ---- reduced-resolution decoding --------------------------------------------------------
def _record_reductions(monkeypatch):
    seen = []
    real = decode_box_module.decode_image

    def spy(data, *, reduce=1, **kw):
        seen.append(reduce)
        return real(data, reduce=reduce, **kw)

    monkeypatch.setattr(decode_box_module, "decode_image", spy)
    return seen


def test_large_jpegs_decode_at_reduced_dct_scale(tmp_path, monkeypatch):
    from recipes.testing import natural_image

    (tmp_path / "c").mkdir()
    photo = natural_image(1500, 2000, np.random.default_rng(0))
    cv2.imwrite(str(tmp_path / "c" / "big.jpg"), photo, [cv2.IMWRITE_JPEG_QUALITY, 90])
    seen = _record_reductions(monkeypatch)
    ds = ImageFolderFast(tmp_path, size=224)
    image, _ = ds[0]
    assert seen == [4]  # the 1312 px crop region -> 224: at least 4x, below 8x
    ref = torchvision.datasets.ImageFolder(tmp_path, transform=_tv_eval(224))[0][0]
    assert _mad(image, ref) < 3.0
    ds.set_resolution(64)  # a coarser scale at low resolution
    assert ds[0][0].shape == (3, 64, 64) and seen[-1] == 8


def test_imagenet_sized_jpegs_decode_at_full_scale(image_tree, monkeypatch):
    seen = _record_reductions(monkeypatch)
    ImageFolderFast(image_tree, size=224, region_decode=False)[0]
    assert seen == [1]  # 375/256 < 2: a smaller DCT scale would lose pixels the output uses


# ---- every mode comes out as 3-channel RGB -------------------------------------------------
def _pil_bytes(image: Image.Image, fmt, **kw):
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _mode_files(tmp_path):
    from recipes.testing import natural_image

    rgb = Image.fromarray(natural_image(300, 400, np.random.default_rng(1))[..., ::-1].copy())
    files = {
        "gray.jpg": _pil_bytes(rgb.convert("L"), "JPEG", quality=90),
        "rgba.png": _pil_bytes(rgb.convert("RGBA"), "PNG"),
        "palette.png": _pil_bytes(rgb.convert("P"), "PNG"),
        "cmyk.jpg": _pil_bytes(rgb.convert("CMYK"), "JPEG", quality=90),
        "progressive.jpg": _pil_bytes(rgb, "JPEG", quality=90, progressive=True),
    }
    gray16 = np.asarray(rgb.convert("L")).astype(np.uint16) * 257
    files["gray16.png"] = cv2.imencode(".png", gray16)[1].tobytes()
    (tmp_path / "m").mkdir()
    for name, data in files.items():
        (tmp_path / "m" / name).write_bytes(data)
    return tmp_path


def test_all_modes_come_out_rgb_like_pil(tmp_path):
    root = _mode_files(tmp_path)
    ours = ImageFolderFast(root, size=128)
    ref = torchvision.datasets.ImageFolder(root, transform=_tv_eval(128))
    for i, (path, _) in enumerate(ours.samples):
        image, _ = ours[i]
        assert image.shape == (3, 128, 128) and image.dtype == torch.uint8, path
        if not path.endswith("gray16.png"):  # Pillow clips 16-bit to 255 instead of scaling
            assert _mad(image, ref[i][0]) < 3.0, path
        if "gray" in path:
            assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])
    gray8 = ours[[p for p, _ in ours.samples].index(str(root / "m" / "gray.jpg"))][0].int()
    gray16 = ours[[p for p, _ in ours.samples].index(str(root / "m" / "gray16.png"))][0].int()
    assert (gray8 - gray16).abs().float().mean() < 3.0  # 16-bit scaled to 8-bit, not clipped


# ---- bad input ----------------------------------------------------------------------------
def _png_header(width, height):
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
        + struct.pack(">I", 0)
        + b"IEND"
        + struct.pack(">I", zlib.crc32(b"IEND"))
    )


def _jpeg_header(width, height):
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00"
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + b"\xff\xd9"


BAD_FILES = {
    "truncated.jpg": lambda good: good[: int(len(good) * 0.6)],
    "empty.jpg": lambda good: b"",
    "page.jpg": lambda good: b"<html><body>404 Not Found</body></html>",
    "bomb.png": lambda good: _png_header(30000, 30000),
    "bomb.jpg": lambda good: _jpeg_header(30000, 30000),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_raise_naming_path_and_index(own_tree, name):
    good = next(own_tree.rglob("*.jpg")).read_bytes()
    (own_tree / "class_00" / name).write_bytes(BAD_FILES[name](good))
    ds = ImageFolderFast(own_tree)
    index = [p for p, _ in ds.samples].index(str(own_tree / "class_00" / name))
    with pytest.raises(ImageDecodeError) as error:
        ds[index]
    assert isinstance(error.value, ValueError)
    assert name in str(error.value) and f"index {index}" in str(error.value)
    if name.startswith("bomb"):
        assert "bomb" in str(error.value) and "30000x30000" in str(error.value)


def test_skip_replaces_with_the_next_good_image_and_counts(own_tree):
    good = next(own_tree.rglob("*.jpg")).read_bytes()
    for name, make in BAD_FILES.items():
        (own_tree / "class_00" / name).write_bytes(make(good))
    ds = ImageFolderFast(own_tree, size=64, on_error="skip")
    paths = [p for p, _ in ds.samples]
    bad = sorted(i for i, p in enumerate(paths) if any(p.endswith(n) for n in BAD_FILES))
    clean = ImageFolderFast(own_tree, size=64)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=uint8_collate, worker_init_fn=worker_init
    )
    images = torch.cat([b[0] for b in loader])
    assert len(images) == len(ds)  # the epoch keeps its length
    for i in range(len(ds)):
        j = i
        while j in bad:
            j = (j + 1) % len(ds)
        assert torch.equal(images[i], clean[j][0]), i  # the next good one, deterministically
    assert ds.skipped == len(BAD_FILES)  # counted inside the worker processes
    assert ds.skipped_indices().tolist() == bad


# ---- train mode, transform, workers --------------------------------------------------------
def test_train_crops_differ_flip_and_are_seeded(image_tree):
    ds = ImageFolderFast(image_tree, size=96, train=True)
    torch.manual_seed(3)
    first = [ds[0][0] for _ in range(6)]
    assert all(x.shape == (3, 96, 96) for x in first)
    assert len({x.float().sum().item() for x in first}) > 1
    again = ImageFolderFast(image_tree, size=96, train=True)
    torch.manual_seed(3)
    assert all(torch.equal(a, again[0][0]) for a in first)


def test_train_augmentations_differ_across_workers(image_tree):
    ds = ImageFolderFast(image_tree, size=64, train=True)
    loader = DataLoader(
        torch.utils.data.Subset(ds, [0, 0, 0, 0]),
        batch_size=1,
        num_workers=2,
        worker_init_fn=worker_init,
        collate_fn=uint8_collate,
    )
    batches = [b[0][0] for b in loader]
    assert not torch.equal(batches[0], batches[1])  # worker 0 and worker 1


def test_transform_runs_on_the_uint8_tensor(image_tree):
    ds = ImageFolderFast(image_tree, size=64, transform=lambda x: 255 - x)
    plain = ImageFolderFast(image_tree, size=64)
    assert torch.equal(ds[1][0], 255 - plain[1][0])


@pytest.mark.slow  # 3-6 s
def test_pickles_and_workers_match_main_process(image_tree):
    ds = pickle.loads(pickle.dumps(ImageFolderFast(image_tree, size=64)))
    main = torch.stack([ds[i][0] for i in range(len(ds))])
    loader = DataLoader(
        ds,
        batch_size=5,
        num_workers=2,
        collate_fn=uint8_collate,
        worker_init_fn=worker_init,
        multiprocessing_context="spawn",
    )
    assert torch.equal(torch.cat([b[0] for b in loader]), main)
