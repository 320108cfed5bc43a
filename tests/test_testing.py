"""The data builders make realistic data (the benchmarks' ratios depend on it)."""

import cv2
import numpy as np
import soundfile as sf

from recipes.testing import (
    make_audio_files,
    make_image_folder,
    make_text_corpus,
    train_tokenizer,
)


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
    paths = make_audio_files(tmp_path, seconds=[0.5, 1.25], sample_rate=8000, channels=2, format="WAV")
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
