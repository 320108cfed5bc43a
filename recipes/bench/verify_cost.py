"""`recipes bench verify`: what the per-item cache checks cost on the warm paths.

Use when: choosing `verify=` ("never", "first_read", "always";
`recipes.common.caches.cache_checks`). The warm rows of `recipes bench vision` (eval view and train
crops, threads and DataLoader workers), the token cache's and the spectrogram cache's thread rows,
each measured under the three modes in one run, taken in turns (best of `--repeat`). "first_read"
keeps the flags of the earlier epochs of the same process (its steady state: threads, persistent
workers); its first epoch costs what "always" costs, and so does every epoch of non-persistent
workers.
Cost: generates the vision bench's images (`--images`) once, 8 minutes of FLAC and a text corpus.
Adapt here: `--images`, `--repeat`, `--workers`.
Trade-off: a 2-core machine shared with other work is noisy: read differences under ~3% as noise.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import recipes.audio.spectrogram_cache as audio
import recipes.nlp.token_cache as nlp
import recipes.vision.cache.eval_view as view
import recipes.vision.cache.image_cache_build as image
from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache, pad_collate
from recipes.bench.harness.measure import best_interleaved, measure, show_table
from recipes.bench.images.data import ensure_data
from recipes.common import LengthBucketSampler, ThreadLoader, make_loader
from recipes.common.caches.cache_checks import algorithm
from recipes.nlp import PadCollate, build_token_cache
from recipes.testing import make_audio_files, make_text_corpus, train_tokenizer
from recipes.vision import ImageFolderFast, build_image_cache, uint8_collate

MODES = ("never", "first_read", "always")


def _set(checks, mode):
    for c in checks:
        c.verify = mode


def _rows(name, make_loader, checks, repeat):
    """`{mode: Measurement}` for one loader, the modes measured in turns."""

    def run(mode):
        _set(checks(), mode)
        return measure(f"{name} [{mode}]", make_loader())

    return best_interleaved(*(functools.partial(run, mode) for mode in MODES), repeat=repeat)


def vision_rows(images: int, workers: int, repeat: int, batch_size: int = 32):
    from torch.utils.data import DataLoader

    root = ensure_data(images)
    out = []
    with tempfile.TemporaryDirectory(prefix="recipes-verify-") as folder:
        warm = ImageFolderFast(root, size=224)
        build_image_cache(warm, folder, num_workers=workers, progress=False)
        train = ImageFolderFast(root, size=224, train=True, cache_dir=folder)
        for label, ds in (("eval view", warm), ("train crops", train)):
            checks = functools.partial(_image_checks, ds)
            out += _rows(
                f"ImageFolderFast warm ({label}), make_loader defaults (threads)",
                lambda ds=ds: make_loader(ds, batch_size=batch_size),
                checks,
                repeat,
            )
            out += _rows(
                f"ImageFolderFast warm ({label}), DataLoader workers",
                lambda ds=ds: DataLoader(
                    ds, batch_size=batch_size, num_workers=workers, collate_fn=uint8_collate
                ),
                checks,
                repeat,
            )
    return out


def _image_checks(dataset) -> list:
    """The checks an ImageFolderFast's warm reads pass: its cache's, and its eval view's when it
    has one."""
    checks = [dataset.cache.checks]
    if dataset.eval_view:
        checks.append(dataset.eval_view.checks)
    return checks


def nlp_rows(samples: int, repeat: int):
    texts = make_text_corpus(samples, seed=0)
    tokenizer = train_tokenizer(texts[:5000], vocab_size=8000)
    with tempfile.TemporaryDirectory(prefix="recipes-verify-") as folder:
        cache = build_token_cache(
            texts, tokenizer, Path(folder) / "c", max_length=512, progress=False
        )
        collate = PadCollate(tokenizer.pad_token_id, pad_to_multiple_of=8)
        return _rows(
            "TokenCache + LengthBucketSampler + PadCollate, threads (make_loader's path)",
            lambda: ThreadLoader(
                cache,
                batch_sampler=LengthBucketSampler(
                    cache.lengths, max_tokens=8192, pad_to_multiple_of=8, seed=0
                ),
                collate_fn=collate,
            ),
            lambda: [cache.checks],
            repeat,
        )


def audio_rows(repeat: int, workers: int):
    import torch

    with tempfile.TemporaryDirectory(prefix="recipes-verify-") as tmp:
        folder = Path(tmp) / "audio"  # 4 x 2 minutes: 120 windows of 4 s
        make_audio_files(folder, count=4, seconds=120.0, seed=1)
        cache = build_spectrogram_cache(
            ChunkedAudioDataset(folder, chunk_seconds=4.0),
            Path(tmp) / "c",
            num_workers=workers,
            progress=False,
        )
        return _rows(
            "SpectrogramCache, threads (make_loader's path)",
            lambda: ThreadLoader(
                cache,
                batch_size=16,
                shuffle=True,
                generator=torch.Generator().manual_seed(0),
                collate_fn=pad_collate,
            ),
            lambda: [cache.checks],
            repeat,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=int, default=800)
    parser.add_argument("--samples", type=int, default=20000, help="texts for the token cache")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=("vision", "nlp", "audio"), default=None)
    parser.add_argument(
        "--checksum",
        choices=("xxh3_64", "crc32"),
        default=None,
        help="build with this hash (default: xxh3_64)",
    )


def run(args: argparse.Namespace) -> int:
    if (
        args.checksum is not None
    ):  # what a build with another hash writes: the builders' choice, replaced
        for module in (audio, nlp, view, image):
            module.algorithm = lambda: args.checksum
    print(f"checksum: {args.checksum or algorithm()}")
    for domain, rows in (
        ("vision", lambda: vision_rows(args.images, args.workers, args.repeat)),
        ("nlp", lambda: nlp_rows(args.samples, args.repeat)),
        ("audio", lambda: audio_rows(args.repeat, args.workers)),
    ):
        if args.only in (None, domain):
            measured = rows()
            for k in range(0, len(measured), len(MODES)):
                loader = measured[k].name.rsplit(" [", 1)[0]
                show_table(
                    f"verify, {domain}: {loader}, verify= {' / '.join(MODES)}",
                    measured[k : k + len(MODES)],
                    plot=getattr(args, "plot", None),
                    name=f"verify-{domain}-{k // len(MODES) + 1}",
                )
    return 0
