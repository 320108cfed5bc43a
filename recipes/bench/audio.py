"""`recipes bench audio`: whole-file loading against chunked reading and the spectrogram cache.

Use when: checking what seeking and caching buy on long recordings (`--data DIR`).
Cost: generates long 16 kHz FLAC recordings once (default: 4 x 5 minutes, plus a 1-minute and
a 30-minute file for the memory check) into a reusable folder, then one shuffled epoch per
loader with the same DataLoader settings; the baseline reads only `--baseline-items` items.
Adapt here: `--chunk-seconds`, `--workers`, `--batch-size`.
Trade-off: the cache row excludes the one-off build, whose time is printed separately.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache, pad_collate
from recipes.audio.spectrogram_cache import featurizer
from recipes.bench.harness.bench_charts import Chart, write_chart
from recipes.bench.harness.measure import measure, peak_rss_growth, show_table
from recipes.bench.harness.train_setup import TrainSetup
from recipes.bench.harness.workers import chosen_workers, worker_init_for, workers_override
from recipes.common import ThreadLoader, make_loader
from recipes.testing import make_audio_files

BENCH_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", type=Path, default=None, help="a folder of audio files (default: generated)"
    )
    parser.add_argument("--chunk-seconds", type=float, default=4.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: smart_num_workers)"
    )
    parser.add_argument(
        "--baseline-items", type=int, default=48, help="items the (slow) baseline reads"
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the 1- vs 30-minute memory check"
    )


class WholeFileWindows:
    """The naive baseline: load the whole file with soundfile, slice the window, featurise."""

    def __init__(self, index, features):
        self.index = index
        self.features = features

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        import soundfile as sf

        ds = self.index
        f = int(ds.item_file[i])
        start = int(ds.item_start[i])
        frames = int(ds.item_frames[i])
        data, _ = sf.read(ds.files[f], dtype="float32", always_2d=True)  # the whole recording
        window = torch.from_numpy(data[start : start + frames].T.copy())
        chunk = round(ds.chunk_seconds * ds.sample_rate)
        window = torch.nn.functional.pad(window, (0, chunk - window.shape[-1]))
        return self.features(window), {"frames": frames}


class OnTheFly:
    """Chunked reading with features computed per item."""

    def __init__(self, dataset, features):
        self.dataset = dataset
        self.features = features

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        wave, info = self.dataset[i]
        return self.features(wave), info


def _data_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recipes" / "bench"
    return base / f"audio-v{BENCH_VERSION}"


def ensure_data() -> tuple[Path, Path, Path]:
    """(folder of 4 x 5-minute FLACs, a 1-minute FLAC, a 30-minute FLAC), generated once."""

    root = _data_root()
    if not (root / ".complete").exists():
        make_audio_files(root / "long", count=4, seconds=300.0, seed=1)
        make_audio_files(root / "one_minute", count=1, seconds=60.0, seed=2)
        make_audio_files(root / "thirty_minutes", count=1, seconds=1800.0, seed=3)
        (root / ".complete").touch()
    return (
        root / "long",
        root / "one_minute" / "audio_0000.flac",
        root / "thirty_minutes" / "audio_0000.flac",
    )


def compare(folder: Path, *, chunk_seconds=4.0, batch_size=16, workers=1, baseline_items=48):
    """(rows, cache build seconds) for the baseline, chunked reading and the cache."""

    chunked = ChunkedAudioDataset(folder, chunk_seconds=chunk_seconds)
    features = featurizer(chunked.sample_rate, n_fft=400, hop_length=160, n_mels=80, log=True)

    def loader(dataset):
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=workers,
            collate_fn=pad_collate,
            worker_init_fn=worker_init_for(workers),
        )

    with tempfile.TemporaryDirectory(prefix="recipes-bench-mel-") as tmp:
        start = time.perf_counter()
        cache = build_spectrogram_cache(
            chunked, Path(tmp) / "cache", num_workers=workers, progress=False
        )
        build_seconds = time.perf_counter() - start
        rows = [
            measure(
                "whole file + slice + mel (baseline)",
                loader(WholeFileWindows(chunked, features)),
                max_items=baseline_items,
            ),
            measure("ChunkedAudioDataset + mel on the fly", loader(OnTheFly(chunked, features))),
            measure("SpectrogramCache, DataLoader workers", loader(cache)),
            measure(
                "SpectrogramCache, threads (make_loader's path)",
                ThreadLoader(
                    cache,
                    batch_size=batch_size,
                    shuffle=True,
                    generator=torch.Generator().manual_seed(0),
                    collate_fn=pad_collate,
                ),
            ),
        ]
    return rows, build_seconds, len(chunked)


def memory_per_item(path: Path, chunk_seconds: float) -> dict[str, int | None]:
    """Peak RSS growth while reading one window of `path`: whole-file baseline vs chunked,
    each measured in a fresh process (a used heap would hide the growth)."""
    import json
    import subprocess
    import sys

    out = {}
    for kind in ("baseline", "chunked"):
        code = (
            "from recipes.bench.audio import _probe; "
            f"_probe({str(path)!r}, {chunk_seconds!r}, {kind!r})"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        out[kind] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def _probe(path: str, chunk_seconds: float, kind: str) -> None:
    chunked = ChunkedAudioDataset([path], chunk_seconds=chunk_seconds)
    features = featurizer(chunked.sample_rate, n_fft=400, hop_length=160, n_mels=80, log=True)
    reader = OnTheFly(chunked, features)
    if kind == "baseline":
        reader = WholeFileWindows(chunked, features)
    OnTheFly(chunked, features)[0]  # warm up allocators and the mel filterbank
    print(peak_rss_growth(lambda: reader[len(chunked) // 2]))


def run(args: argparse.Namespace) -> int:
    plot = getattr(args, "plot", None)
    if args.data is not None:
        folder = args.data
        short = None
        long = None
    else:
        folder, short, long = ensure_data()
    workers = chosen_workers(args.workers)
    rows, build_seconds, count = compare(
        folder,
        chunk_seconds=args.chunk_seconds,
        batch_size=args.batch_size,
        workers=workers,
        baseline_items=args.baseline_items,
    )
    show_table(
        f"audio: {count} windows of {args.chunk_seconds:g} s from {folder}, batch "
        f"{args.batch_size}, {workers} workers (baseline: first {rows[0].items} items)",
        rows,
        unit="items/s",
        plot=plot,
    )
    print(
        f"\nspectrogram cache build: {build_seconds:.1f} s ({count / build_seconds:,.0f} items/s, "
        "one-off)"
    )
    if short is not None and not args.no_memory:
        print(
            "\n| peak memory growth reading one window | 1-minute file (MiB) | 30-minute file "
            "(MiB) |"
        )
        print("|---|---:|---:|")
        one = memory_per_item(short, args.chunk_seconds)
        thirty = memory_per_item(long, args.chunk_seconds)
        names = {"baseline": "whole file (baseline)", "chunked": "ChunkedAudioDataset"}
        for key, name in names.items():
            print(f"| {name} | {one[key] / 2**20:,.1f} | {thirty[key] / 2**20:,.1f} |")
        write_chart(
            Chart(
                "audio-memory",
                "audio: peak memory growth reading one window of a 30-minute file",
                "MiB",
                tuple(names.values()),
                tuple(thirty[k] / 2**20 for k in names),
            ),
            plot,
        )
    return 0


# ---- `recipes bench train --domain audio` --------------------------------------------------
# by whether the device is CUDA: a real model on the GPU, a tiny one that a CPU run can afford
DEFAULT_BATCH = {True: 64, False: 16}
DEFAULT_MODEL = {True: "cnn", False: "tiny"}


def train_setup(args, device):
    """A small CNN classifier on log-mels, fed by whole-file reads, ChunkedAudioDataset with
    features on the fly (cold) and the SpectrogramCache (warm)."""
    cuda = device.type == "cuda"
    batch = args.batch_size or DEFAULT_BATCH[cuda]
    folder, _, _ = ensure_data()
    chunked = ChunkedAudioDataset(folder, chunk_seconds=4.0)
    features = featurizer(chunked.sample_rate, n_fft=400, hop_length=160, n_mels=80, log=True)
    model_name = args.model or DEFAULT_MODEL[cuda]
    step = _audio_step(model_name, device)
    workers = chosen_workers(args.workers)
    start = time.perf_counter()
    cache = build_spectrogram_cache(
        chunked, tempfile.mkdtemp(prefix="recipes-train-bench-mel-"), progress=False
    )
    build = time.perf_counter() - start
    overrides = workers_override(args.workers)
    common = dict(batch_size=batch, shuffle=True, drop_last=True, collate_fn=pad_collate)
    plain = DataLoader(
        WholeFileWindows(chunked, features),
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=worker_init_for(workers),
        pin_memory=cuda,
        **common,
    )

    def to_device(b):
        mels = b["inputs"].to(device, non_blocking=True)
        return mels, torch.arange(len(mels), device=device) % 10  # throughput only: any labels do

    resident = to_device(next(iter(DataLoader(cache, **common))))
    notes = [
        f"{len(chunked)} windows of 4 s from {folder}, batch {batch}; spectrogram cache built in "
        f"{build:.1f} s (one-off)"
    ]
    return TrainSetup(
        "windows",
        step,
        lambda b: len(b[0]),
        resident,
        [
            ("whole file + slice + mel (plain)", plain, to_device),
            (
                "ChunkedAudioDataset + mel, make_loader",
                make_loader(OnTheFly(chunked, features), **common, **overrides),
                to_device,
            ),
            ("SpectrogramCache, make_loader", make_loader(cache, **common, **overrides), to_device),
        ],
        model_name,
        notes,
    )


def _audio_step(name: str, device):
    widths = {"cnn": (64, 128, 256), "tiny": (8, 16, 32)}
    if name not in widths:
        raise ValueError(f"`--model` for audio must be cnn or tiny, but is {name!r} instead.")
    layers = []
    channels = 1
    for width in widths[name]:
        layers += [
            torch.nn.Conv2d(channels, width, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(),
        ]
        channels = width
    model = torch.nn.Sequential(
        *layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = device.type == "cuda"

    def step(batch):
        mels, targets = batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(mels.unsqueeze(1)), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
