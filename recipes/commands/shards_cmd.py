"""`recipes shards DOMAIN ...`: write an image folder, a text corpus or an audio folder as
WebDataset tar or Parquet shards (local or an fsspec URL), or index shards another tool wrote.

Under `torchrun`, every rank writes its share of the shards (`write_shards(distributed=True)`)
and the output is the same bytes as one process writes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch.distributed as dist
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from recipes.common.shards.shard_writer import index_shards, write_shards
from recipes.nlp.texts import TextSource


def add_arguments(parser: argparse.ArgumentParser) -> None:
    domains = parser.add_subparsers(dest="domain", metavar="DOMAIN", required=True)
    for name, source, help_text in (
        (
            "vision",
            "an ImageFolder root (root/<class>/<image>)",
            "an image folder: the encoded files and labels",
        ),
        (
            "text",
            "a .txt, .jsonl(.gz|.zst) or .parquet corpus, local or a URL",
            "a text corpus, one sample each",
        ),
        (
            "audio",
            "a folder searched recursively for WAV/FLAC/OGG files",
            "an audio folder: the encoded files",
        ),
    ):
        sub = domains.add_parser(name, help=f"write {help_text} as shards")
        sub.add_argument("source", help=source)
        sub.add_argument("url", help="the output folder or fsspec URL (s3://bucket/prefix)")
        sub.add_argument("--format", choices=("tar", "parquet"), default="tar")
        sub.add_argument(
            "--shard-mb", type=float, default=64.0, help="shard size in MiB (default 64)"
        )
        sub.add_argument(
            "--no-shuffle",
            dest="shuffle",
            action="store_false",
            help="keep the source's order (default: written in a random order, so that "
            "shards do not hold one class or source each)",
        )
        sub.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
        if name == "text":
            sub.add_argument(
                "--text-field", default="text", help="the JSON field or Parquet column of the text"
            )
        sub.set_defaults(handler=run)
    index = domains.add_parser(
        "index", help="index existing .tar/.parquet shards (writes index.json beside them)"
    )
    index.add_argument("shards", nargs="+", help="the shard files or URLs, in order")
    index.set_defaults(handler=run_index)


def image_folder_samples(root):
    """An image folder as shard samples: key = relative path without extension, the encoded
    file under its extension, `cls` = torchvision's class index."""
    root = os.fspath(root)
    _, class_to_idx = find_classes(root)
    return _FileSamples(root, make_dataset(root, class_to_idx, IMG_EXTENSIONS))


def audio_folder_samples(root):
    """An audio folder as shard samples: key = relative path without extension, the encoded file."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise ValueError(f"{root} is not a folder.")
    files = sorted(
        str(p) for p in Path(root).rglob("*") if p.suffix.lower() in (".wav", ".flac", ".ogg")
    )
    if not files:
        raise ValueError(f"no .wav, .flac or .ogg files under {root}.")
    return _FileSamples(root, [(f, None) for f in files])


def text_samples(source, text_field: str = "text"):
    """A corpus (see `build_token_cache`'s `texts`) as shard samples: `{"__key__", "txt"}`."""
    texts = TextSource(source, text_field=text_field)
    return ({"__key__": f"{i:010d}", "txt": text} for i, text in enumerate(texts._samples()))


class _FileSamples:
    """Samples read from files on demand (a sequence: `write_shards(distributed=True)` indexes
    it)."""

    def __init__(self, root: str, files: list[tuple[str, int | None]]):
        self.root = root
        self.files = files
        first: dict[str, str] = {}
        for (
            path,
            _,
        ) in files:  # two files may map to one key ("a.b.jpg", "a_b.jpg"; "x.jpg", "x.png")
            key = self.key(path)
            if key in first:
                raise ValueError(
                    f"{first[key]} and {path} both become sample key {key!r} (the key is the path "
                    "without its extension, dots replaced by '_'); rename one of them."
                )
            first[key] = path

    def key(self, path: str) -> str:
        rel = os.path.splitext(os.path.relpath(path, self.root))[0]
        directory, stem = os.path.split(rel)
        return os.path.join(directory, stem.replace(".", "_")).replace(os.sep, "/")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        path, label = self.files[index]
        ext = os.path.splitext(path)[1]
        sample = {"__key__": self.key(path), ext[1:].lower(): Path(path).read_bytes()}
        if label is not None:
            sample["cls"] = int(label)
        return sample

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _distributed() -> bool:
    """Under torchrun: join the process group (gloo) so that the ranks share the writing."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return True


def run(args: argparse.Namespace) -> int:
    if args.shard_mb <= 0:
        raise ValueError(f"--shard-mb must be positive, but is {args.shard_mb} instead.")
    if args.domain == "vision":
        samples = image_folder_samples(args.source)
    elif args.domain == "audio":
        samples = audio_folder_samples(args.source)
    else:
        samples = text_samples(args.source, args.text_field)
    distributed = _distributed()
    if distributed and args.domain == "text":
        samples = list(samples)  # every rank needs the sequence
    shards = write_shards(
        samples,
        args.url,
        format=args.format,
        shard_bytes=int(args.shard_mb * 2**20),
        distributed=distributed,
        shuffle=args.shuffle,
        seed=args.seed,
    )
    if not distributed or int(os.environ.get("RANK", "0")) == 0:
        print(f"{shards.url}: {len(shards.entries)} {shards.format} shards, {len(shards)} samples")
    return 0


def run_index(args: argparse.Namespace) -> int:
    shards = index_shards(args.shards)
    print(
        f"{shards.url}/index.json: {len(shards.entries)} {shards.format} shards, {len(shards)} "
        "samples"
    )
    return 0
