"""Audio classification training with the recipes: a complete script to copy and adapt.

    recipes template audio > train.py
    python train.py --audio /data/recordings --cache /nvme/mels
    torchrun --nproc_per_node=8 train.py --audio /data/recordings --cache /nvme/mels
    python train.py --smoke            # generated recordings, a tiny CNN: under a minute on 2 CPUs

What to change for your data (lines marked ADAPT):
  - `label_of`: your labels (here: the recording's index, modulo the classes).
  - `build_model`: your network (a small CNN on log-mels).
  - `--audio` (a folder of WAV/FLAC/OGG), `--cache` (the spectrogram cache), `CHUNK_SECONDS`,
    `SAMPLE_RATE`, the mel settings in `build_spectrogram_cache(...)`.
  - `--max-frames`: padded feature frames per batch per rank (the memory a batch may use).
What each setting buys (measured; README "Benchmarks"):
  - `ChunkedAudioDataset`: each window is a seek and a read, never the whole file: 30-37x
    the items/s of loading whole files, and flat memory from 1- to 30-minute recordings.
  - `build_spectrogram_cache`: log-mels computed once: 200-290x the whole-file baseline.
  - `LengthBucketSampler(max_tokens=...)` over the windows' frame counts: duration bucketing
    under a frame budget, equal batch counts on every rank.
  - `pad_collate`: padded batches with `lengths`, so padding can be masked.
  - `LoaderMonitor` and checkpoints with `loader.state_dict()`: as in the vision template.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache, pad_collate
from recipes.common import LengthBucketSampler, LoaderMonitor, make_loader
from recipes.testing import make_audio_files

CHUNK_SECONDS = 4.0  # ADAPT: the window length (None: one item per recording)
SAMPLE_RATE = 16000  # ADAPT: every file is resampled to this rate
CLASSES = 10  # ADAPT


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--audio", type=Path, help="a folder of audio files (searched recursively)")
    parser.add_argument("--cache", type=Path, help="the spectrogram cache's folder")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs/audio"), help="checkpoints and logs"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--max-frames", type=int, default=64 * 401, help="padded frames per batch per rank"
    )
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--checkpoint-every", type=int, default=500, help="steps between checkpoints"
    )
    parser.add_argument("--smoke", action="store_true", help="generated data and a tiny model")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="exit after N steps (a simulated crash)"
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="log the (file, start) of every window"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
        args.max_frames = 4 * 101
        args.checkpoint_every = 1
    elif args.audio is None or args.cache is None:
        parser.error("--audio and --cache are required (or --smoke)")
    return args


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): torchrun's environment, or a single process."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local = int(os.environ["LOCAL_RANK"])
    if not cuda:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    dist.init_process_group("nccl")
    torch.cuda.set_device(local)
    return dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local}")


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def label_of(batch) -> torch.Tensor:
    """ADAPT: the targets of a batch (here: the file index, modulo the classes)."""
    return batch["file"] % CLASSES


def build_model(n_mels: int, smoke: bool) -> torch.nn.Module:
    """ADAPT: your network; input `[B, 1, n_mels, frames]`."""
    widths = (4, 8) if smoke else (64, 128, 256)
    layers = []
    channels = 1
    for width in widths:
        layers += [
            torch.nn.Conv2d(channels, width, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(),
        ]
        channels = width
    return torch.nn.Sequential(
        *layers,
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(channels, CLASSES),
    )


def prepare_data(args, rank: int, world: int):
    """The spectrogram cache of chunked windows, its features computed by every rank's share."""
    chunk = 1.0 if args.smoke else CHUNK_SECONDS
    if args.smoke:
        args.audio = args.workdir / "audio"
        args.cache = args.workdir / "mels"
        if rank == 0 and not (args.audio / ".complete").exists():
            make_audio_files(args.audio, count=6, seconds=[4.0, 6.5, 3.2, 8.0, 5.1, 2.4], seed=0)
            (args.audio / ".complete").touch()
    barrier(world)
    windows = ChunkedAudioDataset(
        args.audio, chunk_seconds=chunk, sample_rate=SAMPLE_RATE, last_chunk="keep"
    )
    n_mels = 40 if args.smoke else 80
    return build_spectrogram_cache(
        windows, args.cache, n_mels=n_mels, distributed=world > 1
    ), n_mels


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint whole


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    args.workdir.mkdir(parents=True, exist_ok=True)
    cache, n_mels = prepare_data(args, rank, world)
    sampler = LengthBucketSampler(cache.lengths, max_tokens=args.max_frames, seed=0)
    loader = LoaderMonitor(make_loader(cache, batch_sampler=sampler, collate_fn=pad_collate))
    model = build_model(n_mels, args.smoke).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    checkpoint = args.workdir / "checkpoint.pt"
    start_epoch = 0
    step = 0
    loader_state = None
    if checkpoint.exists():  # resume: model, optimiser, and the loader's place in the epoch
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = saved["epoch"]
        step = saved["step"]
        loader_state = saved["loader"]
    if world > 1 and device.type == "cuda":  # batch statistics over every rank's windows
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    log = None
    if args.log_samples:
        log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        if loader_state is not None:
            loader.loader.load_state_dict(loader_state)
            loader_state = None
        start = time.perf_counter()
        loss = None
        for batch in loader:
            mels = (
                batch["inputs"].to(device, non_blocking=True).float().unsqueeze(1)
            )  # [B, 1, n_mels, T]
            targets = label_of(batch).to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(ddp(mels), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if log is not None:
                log.write(
                    " ".join(
                        f"{f}:{s:.3f}"
                        for f, s in zip(
                            batch["file"].tolist(), batch["start"].tolist(), strict=True
                        )
                    )
                    + "\n"
                )
                log.flush()
            if step % args.checkpoint_every == 0 and rank == 0:
                save_checkpoint(
                    checkpoint,
                    model=model.state_dict(),
                    optimizer=optimizer.state_dict(),
                    epoch=epoch,
                    step=step,
                    loader=loader.loader.state_dict(),
                )
            if args.stop_after is not None and step >= args.stop_after:
                barrier(world)
                os._exit(0)  # a simulated crash: no clean-up, as a killed job
        if rank == 0:
            summary = loader.summary()
            loss_text = "-"  # a resume at the epoch's end: no batch left
            if loss is not None:
                loss_text = f"{loss.item():.3f}"
            print(
                f"epoch {epoch}: {time.perf_counter() - start:.1f} s, loss {loss_text}, "
                f"data wait {summary['wait_fraction']:.0%}",
                flush=True,
            )
            save_checkpoint(
                checkpoint,
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                epoch=epoch + 1,
                step=step,
                loader=None,
            )
    if rank == 0:
        print(loader.report())
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
