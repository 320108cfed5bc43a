"""`recipes cache DOMAIN ...`: build a domain's cache from the command line, with a progress bar;
`recipes cache verify DIR`: check every item of one (exit status 1 naming the damaged ones, which
it records in the folder's `damaged.json`: the next build of that cache rebuilds it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from recipes.audio import ChunkedAudioDataset, ShardUtterances, build_spectrogram_cache
from recipes.commands import cache_verify
from recipes.common.shards.shard_set import ShardSet
from recipes.nlp import build_token_cache
from recipes.vision import ImageFolderFast, build_image_cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    domains = parser.add_subparsers(dest="domain", metavar="DOMAIN", required=True)
    vision = domains.add_parser(
        "vision", help="decode an ImageFolder once into a memory-mapped cache"
    )
    vision.add_argument("root", type=Path, help="ImageFolder root (root/<class>/<image>)")
    vision.add_argument("cache_dir", type=Path, help="folder for the cache file")
    vision.add_argument(
        "--size", type=int, default=224, help="training/eval crop size; the cache holds size/0.875"
    )
    vision.add_argument(
        "--workers", type=int, default=None, help="decode workers (default: smart_num_workers)"
    )
    vision.add_argument(
        "--skip-bad", action="store_true", help="replace undecodable images instead of failing"
    )
    vision.set_defaults(handler=run_vision)

    nlp = domains.add_parser("nlp", help="tokenize a corpus once into a memory-mapped token cache")
    nlp.add_argument(
        "texts",
        help=".txt (one sample per line), .jsonl or .parquet file, a folder or glob of "
        "them, or a shard set's folder; local or an fsspec URL",
    )
    nlp.add_argument(
        "tokenizer_dir", type=Path, help="a saved tokenizer folder (tokenizer.json, ...)"
    )
    nlp.add_argument("cache_dir", type=Path, help="the cache folder (replaced atomically)")
    nlp.add_argument("--max-length", type=int, default=None, help="truncate samples to N tokens")
    nlp.add_argument("--text-field", default="text", help="the JSON field of .jsonl lines")
    nlp.add_argument(
        "--no-special-tokens", action="store_true", help="do not add [CLS]/[SEP]-style tokens"
    )
    nlp.set_defaults(handler=run_nlp)

    audio = domains.add_parser("audio", help="compute log-mel features of a folder of audio once")
    audio.add_argument(
        "audio_dir",
        type=Path,
        help="folder searched recursively for WAV/FLAC/OGG files, or a shard set's "
        "folder (index.json; one item per sample)",
    )
    audio.add_argument("cache_dir", type=Path, help="the cache folder (replaced atomically)")
    audio.add_argument(
        "--chunk-seconds", type=float, default=None, help="window length (default: whole files)"
    )
    audio.add_argument("--sample-rate", type=int, default=None, help="resample to this rate")
    audio.add_argument("--n-mels", type=int, default=80)
    audio.add_argument(
        "--workers", type=int, default=None, help="feature workers (default: smart_num_workers)"
    )
    audio.set_defaults(handler=run_audio)

    verify = domains.add_parser(
        "verify", help="check every item of a cache folder against its checksums"
    )
    verify.add_argument(
        "cache_dir", type=Path, help="a cache folder, or a folder of image caches (images-*)"
    )
    verify.set_defaults(handler=run_verify)


def run_vision(args: argparse.Namespace) -> int:
    on_error = "raise"
    if args.skip_bad:
        on_error = "skip"
    dataset = ImageFolderFast(args.root, size=args.size, on_error=on_error)
    cache = build_image_cache(dataset, args.cache_dir, num_workers=args.workers, progress=True)
    skipped = ""
    if cache.skipped:
        skipped = f", {len(cache.skipped)} bad images replaced"
    print(f"{cache.path}: {cache.count} images, longer side at most {cache.max_side}{skipped}")
    return 0


def run_nlp(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    if not args.tokenizer_dir.is_dir():
        raise ValueError(
            f"{args.tokenizer_dir} is not a folder; save a tokenizer with "
            "tokenizer.save_pretrained(DIR) and pass DIR."
        )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir, local_files_only=True)
    cache = build_token_cache(
        args.texts,
        tokenizer,
        args.cache_dir,
        max_length=args.max_length,
        add_special_tokens=not args.no_special_tokens,
        text_field=args.text_field,
    )
    print(
        f"{cache.path}: {len(cache)} samples, {cache.header['num_tokens']:,} tokens "
        f"({cache.header['dtype']})"
    )
    return 0


def run_audio(args: argparse.Namespace) -> int:
    if (args.audio_dir / "index.json").is_file():  # shards (issue 27): utterances, no windows
        if args.chunk_seconds is not None:
            raise ValueError(
                "--chunk-seconds does not apply to shards (one item per sample); cut windows "
                "before writing the shards."
            )
        dataset = ShardUtterances(ShardSet.open(args.audio_dir), sample_rate=args.sample_rate)
    else:
        dataset = ChunkedAudioDataset(
            args.audio_dir, chunk_seconds=args.chunk_seconds, sample_rate=args.sample_rate
        )
    cache = build_spectrogram_cache(
        dataset, args.cache_dir, n_mels=args.n_mels, num_workers=args.workers
    )
    print(
        f"{cache.path}: {len(cache)} items, {cache.n_mels} mels, {cache.header['layout']} layout, "
        f"{int(cache.lengths.sum()):,} frames"
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    return cache_verify.run(args)
