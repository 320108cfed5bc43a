"""Builders of small, realistic data for tests and the default benchmarks.

Use when: a test or benchmark needs images, audio, text or a tokenizer without downloading
anything. Everything is generated from a seed, so runs are reproducible.
Cost: about 5 ms per 500x375 JPEG, 30 ms per minute of 16 kHz FLAC, a second or two to
train a 2k-token BPE tokenizer on a few thousand lines.
Adapt here: sizes, counts and distributions are keyword arguments.
Trade-off: synthetic content compresses like photos (multi-octave noise, edges) but is not a
photo; decode-speed ratios carry over, absolute accuracy numbers do not. `make_image_folder`
writes one size of smooth content; `make_photo_folder` (from `recipes.testing_photos`) writes
what users have: ImageNet's sizes, 1/f content, grayscale, CMYK, progressive, EXIF-rotated
files. The fake servers (HTTP with faults, moto S3, a throttling proxy) are in
`recipes.testing_servers`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recipes.testing_photos import make_photo_folder as make_photo_folder  # re-exported

# Lowercase syllables composed into a Zipf-distributed vocabulary of made-up words.
_SYLLABLES = "ka lo mi ne ru sa ti vo bel dan fer gon hul jis kor lum mar nes pol quin rast".split()


def natural_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A BGR uint8 image with photo-like statistics: 1/f noise octaves, shapes with soft edges,
    textured regions (foliage, fur, fabric) beside smooth ones, and sensor grain.

    At 500x375 and JPEG quality 90 it compresses to about 50-70 KB.
    """
    import cv2

    image = np.zeros((height, width, 3), np.float32)
    for octave in range(1, 9):
        cells = 2**octave
        grid = rng.normal(0.0, 1.0, (cells, cells * width // height + 1, 3)).astype(np.float32)
        image += cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC) * (60.0 / octave)
    image += 128.0
    for _ in range(rng.integers(3, 8)):
        center = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        color = tuple(float(c) for c in rng.integers(0, 256, 3))
        radius = int(rng.integers(min(height, width) // 12, min(height, width) // 3))
        cv2.circle(image, center, radius, color, thickness=-1, lineType=cv2.LINE_AA)
    mask = cv2.resize(
        rng.random((4, 5)).astype(np.float32), (width, height), interpolation=cv2.INTER_CUBIC
    )
    mask = np.clip((mask - 0.4) * 3.0, 0.0, 1.0)[..., None]
    texture = rng.normal(0.0, 18.0, (height // 2 + 1, width // 2 + 1)).astype(np.float32)
    image += mask * cv2.resize(texture, (width, height), interpolation=cv2.INTER_LINEAR)[..., None]
    image += rng.normal(0.0, 2.0, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def make_image_folder(
    root: str | Path,
    *,
    classes: int = 3,
    per_class: int = 8,
    size: tuple[int, int] = (500, 375),
    quality: int = 90,
    seed: int = 0,
    jitter: float = 0.2,
) -> Path:
    """Writes `root/class_XX/img_YYYY.jpg` JPEGs like ImageNet's (about 500x375, quality 90).

    Args:
        root: the folder to fill (created).
        classes: number of class folders.
        per_class: images per class.
        size: (width, height) of a typical image; each varies by +-`jitter` and half are
            portrait, as in ImageNet.
        quality: JPEG quality.
        seed: the generator seed.
        jitter: relative size variation.

    Returns:
        `root` as a Path.
    """
    import cv2

    root = Path(root)
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = (int(s * rng.uniform(1 - jitter, 1 + jitter)) for s in size)
            if rng.random() < 0.3:
                w, h = h, w
            image = natural_image(h, w, rng)
            path = folder / f"img_{i:04d}.jpg"
            if not cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, quality]):
                raise OSError(f"OpenCV could not write {path}")
    return root


def make_int_shards(folder: str | Path, sizes: list[int]) -> list[str]:
    """Writes text shards of consecutive integers (shard k holds the next `sizes[k]` numbers,
    space-separated): sample identities for exactly-once tests of sharded readers.

    Returns:
        The shard paths, in order.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    start = 0
    for k, size in enumerate(sizes):
        path = folder / f"s{k}.txt"
        path.write_text(" ".join(str(i) for i in range(start, start + size)))
        paths.append(str(path))
        start += size
    return paths


def make_audio_files(
    root: str | Path,
    *,
    count: int = 3,
    seconds: float | list[float] = 2.0,
    sample_rate: int = 16000,
    channels: int = 1,
    format: str = "FLAC",
    subtype: str | None = None,
    seed: int = 0,
) -> list[Path]:
    """Writes speech-like audio files (gliding harmonics, syllable envelope, noise).

    Args:
        root: the folder to fill (created).
        count: number of files.
        seconds: duration of every file, or one duration per file.
        sample_rate: frames per second.
        channels: 1 for mono, 2 for stereo.
        format: a soundfile format, `FLAC`, `WAV` or `OGG`.
        subtype: a soundfile subtype (e.g. `PCM_16`, `FLOAT`); the format's default when None.
        seed: the generator seed.

    Returns:
        The written paths, in order.
    """
    import soundfile as sf

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    durations = seconds if isinstance(seconds, list) else [seconds] * count
    suffix = {"FLAC": ".flac", "WAV": ".wav", "OGG": ".ogg"}[format.upper()]
    paths = []
    for i, duration in enumerate(durations):
        frames = int(round(duration * sample_rate))
        wave = np.stack([_speech_like(frames, sample_rate, rng) for _ in range(channels)], axis=1)
        path = root / f"audio_{i:04d}{suffix}"
        sf.write(path, wave, sample_rate, format=format, subtype=subtype)
        paths.append(path)
    return paths


def _speech_like(frames: int, sample_rate: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(frames, dtype=np.float64) / sample_rate
    pitch = 120.0 + 40.0 * np.sin(2 * np.pi * rng.uniform(0.1, 0.5) * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(2.0, 5.0) * t)) ** 2
    noise = rng.normal(0.0, 0.02, frames)
    return (0.2 * voice * envelope + noise).astype(np.float32)


def make_text_corpus(count: int = 1000, *, median_words: int = 40, seed: int = 0) -> list[str]:
    """Sentences with a long-tailed (log-normal) length distribution and Zipfian words.

    Most samples are short and a few are 20x longer, as in chat, web or speech transcripts,
    which is what makes random batching waste padding.
    """
    rng = np.random.default_rng(seed)
    vocab = ["".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))) for _ in range(3000)]
    ranks = np.arange(1, len(vocab) + 1)
    probs = (1.0 / ranks) / np.sum(1.0 / ranks)
    lengths = np.clip(rng.lognormal(np.log(median_words), 0.9, count), 1, 50 * median_words)
    texts = []
    for n in lengths.astype(int):
        words = rng.choice(len(vocab), size=n, p=probs)
        texts.append(" ".join(vocab[w] for w in words).capitalize() + ".")
    return texts


def train_tokenizer(texts: list[str], *, vocab_size: int = 2000, special_tokens=None):
    """A BPE `PreTrainedTokenizerFast` trained on `texts` with `[CLS] ... [SEP]` framing.

    Args:
        texts: the training corpus.
        vocab_size: target vocabulary size.
        special_tokens: mapping of role to token; defaults to pad/unk/cls/sep/mask.

    Returns:
        A `transformers.PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
        **(special_tokens or {}),
    }
    tokenizer = Tokenizer(models.BPE(unk_token=special["unk_token"]))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special.values()), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    cls = special["cls_token"]
    sep = special["sep_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
