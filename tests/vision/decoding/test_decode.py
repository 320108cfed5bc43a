"""Strict decoding (issue 19): bit flips inside a JPEG's entropy-coded scan data, which
libjpeg-turbo resynchronises past and reports only as a stderr warning, raise
`ImageDecodeError` on every CPU decode path; clean JPEGs of every kind never do.

The independent expectation is libjpeg's own report: each mutated file is decoded with
`strict=False` while fd 2 points at a pipe of the test's own, and what libjpeg printed there
says whether it found damage. Strict decodes must raise for exactly those files. Only part of
the flips desynchronise the decoder: libjpeg finds the others nowhere, and neither can we."""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from recipes.common import make_loader
from recipes.vision import ImageDecodeError, ImageFolderFast, uint8_collate
from recipes.vision.decoding.decode import decode_image, turbo_available
from recipes.vision.decoding.jpeg_damage import checked_by_libjpeg
from recipes.vision.decoding.region_decode import decode_region, region_decode_available

from .test_region_decode import _jpegs

FLIPS_PER_KIND = 8
DAMAGE = ("Corrupt JPEG data", "Premature end of JPEG file")


def _scan_ranges(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan's entropy-coded data: after each SOS header, up to the next
    marker that is not a stuffed 0xFF00 or a restart marker."""
    ranges, pos = [], 0
    while (sos := data.find(b"\xff\xda", pos)) >= 0:
        start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
        end = start
        while end < len(data) - 1 and not (
            data[end] == 0xFF and data[end + 1] not in (0x00, *range(0xD0, 0xD8))
        ):
            end += 1
        ranges.append((start, end))
        pos = end
    return ranges


def _flip_in_scan(data: bytes, rng: np.random.Generator) -> bytes:
    """One bit flipped at a random byte of the scan data, never making or breaking a marker."""
    ranges = [(start, end) for start, end in _scan_ranges(data) if end - start > 4]
    out = bytearray(data)
    while True:
        start, end = ranges[int(rng.integers(len(ranges)))]
        pos = int(rng.integers(start + 1, end - 1))
        flipped = out[pos] ^ (1 << int(rng.integers(8)))
        if 0xFF not in (out[pos], out[pos - 1], flipped):
            out[pos] = flipped
            return bytes(out)


@pytest.fixture(scope="module")
def kinds():
    return (
        _jpegs()
    )  # 4:2:0, 4:2:2, 4:4:4, progressive, restart markers, gray, EXIF-rotated (300x400)


@pytest.fixture(scope="module")
def mutated(kinds):
    rng = np.random.default_rng(19)
    return {
        f"{kind}-{k}": _flip_in_scan(data, rng)
        for kind, data in sorted(kinds.items())
        for k in range(FLIPS_PER_KIND)
    }


@pytest.fixture(scope="module")
def damaged(mutated):
    """The mutated files libjpeg reports (decoded by OpenCV's libjpeg-turbo, unchecked: its
    stderr is read at fd level; TurboJPEG through simplejpeg prints nothing)."""
    import cv2

    found = set()  # (capfd is function-scoped: fd 2 is read through a pipe here)
    read, write = os.pipe()
    saved = os.dup(2)
    try:
        for name, data in mutated.items():
            os.dup2(write, 2)
            try:
                cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
            finally:
                os.dup2(saved, 2)
            os.write(write, b"\0")  # a separator, so an empty report reads as empty
            report = b""
            while not report.endswith(b"\0"):
                report += os.read(read, 65536)
            if any(d in report.decode() for d in DAMAGE):
                found.add(name)
    finally:
        os.close(saved)
        os.close(read)
        os.close(write)
    return found


def _tree(tmp_path, files: dict[str, bytes]):
    (tmp_path / "t" / "c").mkdir(parents=True)
    for name, data in files.items():
        (tmp_path / "t" / "c" / f"{name.replace(' ', '_')}.jpg").write_bytes(data)
    return tmp_path / "t"


def test_libjpeg_reports_desynchronising_flips_as_garbage_and_misses_others(
    mutated, damaged, kinds
):
    """What the oracle says, so that what strict promises stays honest: the flips libjpeg
    reports leave blocks of garbage; many others keep its Huffman decoder in sync (a changed
    coefficient or DC difference) and are reported by nothing (the module docstring says so)."""
    assert len(damaged) >= 10 and len(mutated) - len(damaged) >= 10, sorted(damaged)
    for name in damaged:
        clean = decode_image(kinds[name.rsplit("-", 1)[0]]).astype(int)
        assert np.abs(decode_image(mutated[name], strict=False).astype(int) - clean).max() > 30, (
            name
        )


def test_strict_decode_raises_for_exactly_what_libjpeg_reports(mutated, damaged):
    for name, data in mutated.items():
        for reduce in (1, 2, 4, 8):  # the DCT-scaled decodes read the whole scan as well
            if name in damaged:
                with pytest.raises(
                    ImageDecodeError, match=r"'x.jpg' \(index 3\) has damaged JPEG data"
                ):
                    decode_image(data, reduce=reduce, path="x.jpg", index=3)
            else:
                decode_image(data, reduce=reduce)


@pytest.mark.skipif(
    not region_decode_available(), reason='needs nvImageCodec (pip install "loader-recipes[roi]")'
)
def test_strict_region_decode_reads_to_the_end_and_raises_the_same(mutated, damaged, kinds):
    boxes = [
        (0, 0, 40, 60),
        (130, 170, 50, 70),
        (260, 300, 40, 100),
    ]  # top, middle, bottom of 300x400
    for name, data in mutated.items():
        for box in boxes:
            if name in damaged:
                with pytest.raises(ImageDecodeError, match="damaged JPEG data"):
                    decode_region(data, box, path=name)
            else:
                assert decode_region(data, box) is not None
    for kind, data in kinds.items():  # no false positive, and still the pixels of the crop
        full = decode_image(data)
        for top, left, h, w in boxes:
            np.testing.assert_array_equal(
                decode_region(data, (top, left, h, w)),
                full[top : top + h, left : left + w],
                err_msg=kind,
            )


@pytest.mark.parametrize(
    "size", [224, 128, 64, 32]
)  # DCT scales 1, 2, 4 and 8 for these 300x400 files
@pytest.mark.parametrize("train", [False, True])
def test_every_dataset_path_raises_naming_the_file_and_clean_files_never_do(
    tmp_path, mutated, damaged, kinds, size, train
):
    root = _tree(tmp_path, {**kinds, **mutated})
    ds = ImageFolderFast(root, size=size, train=train)
    for i, (path, _) in enumerate(ds.samples):
        name = os.path.basename(path)[: -len(".jpg")].replace("_", " ")
        torch.manual_seed(i)
        if name in damaged:
            with pytest.raises(ImageDecodeError) as error:
                ds[i]
            assert (
                path in str(error.value)
                and f"index {i}" in str(error.value)
                and "strict=False" in str(error.value)
            )
        else:
            assert ds[i][0].shape == (3, size, size)


def test_unchecked_mode_serves_what_the_decoder_recovers(tmp_path, mutated, damaged):
    root = _tree(tmp_path, {name: mutated[name] for name in sorted(damaged)[:4]})
    ds = ImageFolderFast(root, size=64, strict=False)
    assert all(ds[i][0].shape == (3, 64, 64) for i in range(len(ds)))


@pytest.mark.skipif(
    not region_decode_available(), reason='needs nvImageCodec (pip install "loader-recipes[roi]")'
)
def test_each_file_is_checked_once_then_region_decoded_with_the_same_pixels(
    tmp_path, mutated, damaged, kinds, monkeypatch
):
    # where ImageFolderFast._decode_box looks it up
    import recipes.vision.decoding.region_decode as module

    strictness = []
    real = module.decode_region

    def spy(data, box, **kwargs):
        strictness.append(kwargs["strict"])
        return real(data, box, **kwargs)

    monkeypatch.setattr(module, "decode_region", spy)
    bad = sorted(damaged)[:4]
    root = _tree(tmp_path, {**kinds, **{name: mutated[name] for name in bad}})
    ds = ImageFolderFast(root, size=224, region_decode=True)  # eval: the same crop every pass
    passes = []
    for _ in range(2):
        strictness.clear()
        images, raised = {}, 0
        for i in range(len(ds)):
            try:
                images[i] = ds[i][0]
            except ImageDecodeError:
                raised += 1
        passes.append((images, raised, list(strictness)))
    (first, raised_1, strict_1), (second, raised_2, strict_2) = passes
    assert raised_1 == raised_2 == len(bad)  # a damaged file is never marked checked
    if (
        turbo_available()
    ):  # first decodes are TurboJPEG's whole decodes (the whole scan read, the GIL released)
        assert strict_1 == [] and strict_2 == [False] * len(
            kinds
        )  # then only the crop of a checked file
    else:  # first decodes are region decodes that read to the bottom
        assert strict_1 == [True] * len(ds)
        assert sorted(strict_2) == [False] * len(kinds) + [True] * len(bad)
    assert first.keys() == second.keys() and all(torch.equal(first[i], second[i]) for i in first)


def test_skip_counts_the_damaged_files_in_workers(tmp_path, mutated, damaged, kinds):
    root = _tree(tmp_path, {**kinds, **mutated})
    ds = ImageFolderFast(root, size=64, on_error="skip")
    loader = make_loader(
        ds, batch_size=16, num_workers=2, pin_memory=False, collate_fn=uint8_collate
    )
    assert sum(len(batch[1]) for batch in loader) == len(ds)
    names = [os.path.basename(p)[: -len(".jpg")].replace("_", " ") for p in ds.paths]
    assert ds.skipped == len(damaged)
    assert ds.skipped_indices().tolist() == [i for i, n in enumerate(names) if n in damaged]


def test_other_stderr_text_passes_through_and_stderr_is_restored(capfd):
    def noisy():
        os.write(2, b"Warning: unknown JFIF revision number 3.01\nsomething else\n")
        return 7

    assert checked_by_libjpeg(noisy) == 7
    assert capfd.readouterr().err == "Warning: unknown JFIF revision number 3.01\nsomething else\n"

    def failing():
        os.write(2, b"Corrupt JPEG data: 30 extraneous bytes before marker 0xd9\n")
        raise RuntimeError("decoder failed")

    with pytest.raises(RuntimeError):
        checked_by_libjpeg(failing)
    assert checked_by_libjpeg(lambda: 1) == 1  # nothing left over from the failed call
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_threads_get_their_own_reports(mutated, damaged):
    """fd 2 is one per process: concurrent strict decodes take turns, each reading its own
    report."""
    names = sorted(mutated) * 3

    def raises(name):
        try:
            decode_image(mutated[name])
            return False
        except ImageDecodeError:
            return True

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(raises, names)) == [name in damaged for name in names]


@pytest.mark.parametrize("size", [(224, 224), (100, 160), (300, 200)])  # down, down, up
def test_resize_writes_torchvisions_pixels_into_any_row_layout(size):
    """`resize_uint8` against torchvision's own resize (PIL-free, antialiased bilinear), into a
    channels-last batch row (what the thread path writes), into a planar row, and into a new
    tensor, from contiguous and column-sliced input, mirrored or not."""
    import numpy as np
    import torch
    import torchvision.transforms.v2.functional as F

    from recipes.vision.decoding.decode import resize_uint8

    rng = np.random.default_rng(0)
    whole = rng.integers(0, 256, (260, 340, 3), dtype=np.uint8)
    for image in (whole, whole[:, 20:300]):
        expected = F.resize(
            torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1),
            list(size),
            antialias=True,
        )
        fresh = resize_uint8(image, size)
        assert fresh.permute(1, 2, 0).is_contiguous()  # channels-last in memory
        channels_last = torch.zeros((2, *size, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
        planar = torch.zeros((2, 3, *size), dtype=torch.uint8)
        for mirror in (False, True):
            want = expected.flip(-1) if mirror else expected
            for out in (channels_last[1], planar[1]):
                assert resize_uint8(image, size, out=out, mirror=mirror) is out
            for got in (
                resize_uint8(image, size, mirror=mirror) if mirror else fresh,
                channels_last[1],
                planar[1],
            ):
                assert torch.equal(got, want), mirror
            assert (
                not channels_last[0].any() and not planar[0].any()
            )  # the neighbouring row untouched
    same = whole[:224, 10:234]  # no resize: copied (or mirrored) from a column slice
    for mirror in (False, True):
        row = torch.zeros((224, 224, 3), dtype=torch.uint8).permute(2, 0, 1)
        want = torch.from_numpy(np.ascontiguousarray(same)).permute(2, 0, 1)
        assert torch.equal(
            resize_uint8(same, (224, 224), out=row, mirror=mirror),
            want.flip(-1) if mirror else want,
        )


@pytest.mark.parametrize("strict", [False, True])
def test_turbojpeg_and_opencv_paths_agree_on_cut_progressive_files(strict, monkeypatch):
    """TurboJPEG pads a progressive scan cut short and returns made-up rows where OpenCV gives
    up (and Pillow raises): a file TurboJPEG warns about goes the old path, strict or not."""
    import cv2
    import simplejpeg

    import recipes.vision.decoding.decode as decode

    y, x = np.mgrid[0:120, 0:160].astype(
        np.float32
    )  # waves, noise and sharp edges (the review's case)
    image = np.stack([128 + 100 * np.sin(x / 17 + c) * np.cos(y / 23 - c) for c in range(3)], -1)
    image += np.random.default_rng(0).normal(0, 20, image.shape)
    image[(x // 37 + y // 29) % 5 == 0] = [250, 20, 40]
    image = np.clip(image, 0, 255).astype(np.uint8)
    whole = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()

    def outcome(data):
        try:
            return decode.decode_image(data, strict=strict).tobytes()
        except ImageDecodeError as error:
            return type(error)

    padded = 0  # cuts TurboJPEG alone would have served: the case this test is about
    for end in range(200, len(whole) - 2, 97):  # cuts all through the scans
        cut = whole[:end] + b"\xff\xd9"
        opencv = cv2.imdecode(np.frombuffer(cut, np.uint8), cv2.IMREAD_COLOR)
        try:
            simplejpeg.decode_jpeg(cut, strict=False)
            padded += opencv is None
        except ValueError:
            pass
        new = outcome(cut)
        monkeypatch.setattr(decode, "_SIMPLEJPEG", False)
        old = outcome(cut)
        monkeypatch.undo()
        assert new == old, end
    assert padded, "no cut that TurboJPEG pads and OpenCV refuses: the test checks nothing"


def test_data_after_the_end_of_image_is_not_the_images_and_a_thumbnail_hides_no_truncation():
    """A Motion Photo (a JPEG, then its video) decodes as the JPEG alone, as Pillow does, even
    when the trailer holds a start-of-scan marker and no end-of-image one; a main image cut
    short still raises when its EXIF thumbnail (a whole JPEG inside APP1) ends properly."""
    from recipes.vision.decoding.image_header import read_header

    jpeg = _jpegs()["4:2:0"]
    trailer = (
        b"\x00\x00\x00\x18ftypmp42"
        + bytes(range(256)) * 40
        + b"\xff\xda\x00\x08 moov"
        + bytes(range(200))
    )
    assert trailer.rfind(b"\xff\xd9") < trailer.rfind(b"\xff\xda")
    motion = jpeg + trailer
    for strict in (True, False):
        np.testing.assert_array_equal(decode_image(motion, strict=strict), decode_image(jpeg))
    thumbnail = _jpegs()["gray"]
    app1 = b"Exif\x00\x00" + thumbnail
    with_thumbnail = jpeg[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + jpeg[2:]
    np.testing.assert_array_equal(decode_image(with_thumbnail), decode_image(jpeg))
    cut = with_thumbnail[: len(with_thumbnail) - len(jpeg) // 2]
    for strict in (True, False):
        with pytest.raises(ImageDecodeError, match="truncated JPEG"):
            decode_image(cut, header=read_header(cut), strict=strict)
