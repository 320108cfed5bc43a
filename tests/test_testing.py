"""The data builders make realistic data (the benchmarks' ratios depend on it)."""

import cv2
import numpy as np
import pytest
import soundfile as sf

from recipes.testing import (
    make_audio_files,
    make_image_folder,
    make_text_corpus,
    train_tokenizer,
)
from recipes.testing_photos import make_photo_folder, plan_photos, spectrum_slope


def test_image_folder_is_imagenet_like(tmp_path):
    root = make_image_folder(tmp_path, classes=2, per_class=4)
    files = sorted(root.glob("*/*.jpg"))
    assert len(files) == 8 and {f.parent.name for f in files} == {"class_00", "class_01"}
    sizes = [f.stat().st_size for f in files]
    # 500x375 photos at quality 90 are tens of KB (ImageNet's average, ~110 KB, has larger images).
    assert 30_000 < np.median(sizes) < 200_000, sizes
    for f in files:
        image = cv2.imread(str(f))
        assert image is not None and image.shape[2] == 3
        assert 250 <= min(image.shape[:2]) and max(image.shape[:2]) <= 650


def test_image_folder_is_deterministic(tmp_path):
    a = make_image_folder(tmp_path / "a", classes=1, per_class=2, seed=3)
    b = make_image_folder(tmp_path / "b", classes=1, per_class=2, seed=3)
    for x, y in zip(sorted(a.rglob("*.jpg")), sorted(b.rglob("*.jpg")), strict=True):
        assert x.read_bytes() == y.read_bytes()


def test_audio_files(tmp_path):
    paths = make_audio_files(
        tmp_path, seconds=[0.5, 1.25], sample_rate=8000, channels=2, format="WAV"
    )
    infos = [sf.info(p) for p in paths]
    assert [i.frames for i in infos] == [4000, 10000]
    assert {i.channels for i in infos} == {2} and {i.samplerate for i in infos} == {8000}
    data, _ = sf.read(paths[1])
    assert 0.01 < np.abs(data).mean() < 1.0


def test_text_corpus_is_long_tailed():
    texts = make_text_corpus(2000, median_words=30, seed=1)
    words = np.array([len(t.split()) for t in texts])
    assert 20 <= np.median(words) <= 40
    assert np.percentile(words, 99) > 5 * np.median(words)
    assert texts == make_text_corpus(2000, median_words=30, seed=1)


def test_trained_tokenizer_frames_with_special_tokens():
    texts = make_text_corpus(300, seed=2)
    tok = train_tokenizer(texts, vocab_size=500)
    ids = tok(texts[0])["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok(texts[0], add_special_tokens=False)["input_ids"] == ids[1:-1]
    assert tok.is_fast and tok.pad_token == "[PAD]" and len(tok) <= 500


# ---- the photographic set (issue #30) ----------------------------------------------------
@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return make_photo_folder(tmp_path_factory.mktemp("photos"), images=40, classes=4, seed=0)


def test_photo_sizes_follow_imagenet():
    specs = plan_photos(3000, seed=1)
    long = np.array([max(s.width, s.height) for s in specs])
    short = np.array([min(s.width, s.height) for s in specs])
    assert 450 <= np.median(long) <= 550 and 330 <= np.median(short) <= 400  # ImageNet: 500x375
    portrait = np.mean([s.height > s.width for s in specs])
    assert 0.15 < portrait < 0.35, portrait
    assert long.min() < 200 and 2500 < long.max() <= 4000
    assert np.mean(long > 2500) <= 0.02  # the very large are few: generation time stays bounded
    assert np.mean(short < 512) > 0.8  # a 224 eval crop mostly gets no 1/2 DCT-scaled decode


def test_photo_folder_holds_every_kind(photos):
    from PIL import Image, JpegImagePlugin

    specs = {s.path: s for s in plan_photos(40, classes=4, seed=0)}
    assert sorted(str(p.relative_to(photos)) for p in photos.rglob("*.jpg")) == sorted(specs)
    modes, sampling, progressive, orientations = set(), set(), 0, set()
    for path, spec in specs.items():
        with Image.open(photos / path) as image:
            assert image.size == (spec.width, spec.height) and image.mode == spec.mode
            modes.add(image.mode)
            if image.mode == "RGB":
                sampling.add(JpegImagePlugin.get_sampling(image))
            progressive += bool(image.info.get("progressive"))
            orientations.add(image.getexif().get(0x0112, 1))
    assert modes == {"RGB", "L", "CMYK"} and sampling == {0, 2}  # 4:4:4 and 4:2:0
    assert 1 <= progressive < 40 and orientations - {1}, (progressive, orientations)


def test_photo_folder_is_deterministic(tmp_path):
    a = make_photo_folder(tmp_path / "a", images=5, classes=2, seed=3, processes=0)
    b = make_photo_folder(tmp_path / "b", images=5, classes=2, seed=3, processes=2)
    c = make_photo_folder(tmp_path / "c", images=5, classes=2, seed=4)
    files = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files) == 5 and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in files)


def test_photos_have_a_natural_power_spectrum(photos, tmp_path):
    slopes = [spectrum_slope(cv2.imread(str(p))) for p in sorted(photos.rglob("*.jpg"))]
    # photographs: about -2 (power falling as 1/f^2); measured -1.8 to -3.1 here, median -2.3
    assert -3.0 < np.median(slopes) < -1.8 and np.mean([-3.5 < s < -1.5 for s in slopes]) >= 0.9, (
        slopes
    )
    generated = make_image_folder(tmp_path, classes=1, per_class=8, seed=0)
    other = [spectrum_slope(cv2.imread(str(p))) for p in sorted(generated.rglob("*.jpg"))]
    assert -3.5 < np.median(other) < -1.5, other  # the generated set's octaves are 1/f too (~ -2.4)


def test_both_readers_read_every_photo(photos):
    """ImageFolderFast and torchvision's ImageFolder read each kind; both ignore EXIF
    orientation."""
    import torchvision
    import torchvision.transforms as T
    from PIL import Image, ImageOps

    from recipes.vision import ImageFolderFast

    eval_transform = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    reference = torchvision.datasets.ImageFolder(photos, transform=eval_transform)
    fast, train = ImageFolderFast(photos, size=224), ImageFolderFast(photos, size=224, train=True)
    assert fast.samples == reference.samples
    for i, (path, _) in enumerate(reference.samples):
        ours, theirs = fast[i][0].int(), reference[i][0].int()
        assert ours.shape == theirs.shape == (3, 224, 224) and train[i][0].shape == (3, 224, 224), (
            path
        )
        # the same pixels decoded (libjpeg-turbo both); crop-before-resize and the resize
        # filter differ by a few grey levels on textured content (1-5 measured)
        assert (ours - theirs).abs().float().mean() < 8, path
        with Image.open(path) as image:
            if image.getexif().get(0x0112, 1) != 1:  # torchvision's convention: stored pixels
                shown = eval_transform(ImageOps.exif_transpose(image).convert("RGB")).int()
                assert (ours - theirs).abs().float().mean() < (ours - shown).abs().float().mean(), (
                    path
                )
