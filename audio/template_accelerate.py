"""Audio classification training with the recipes under Hugging Face Accelerate: a script to copy
and adapt.

    recipes template audio --framework accelerate > train.py
    accelerate launch train.py --audio /data/recordings --cache /nvme/mels
    torchrun --nproc_per_node=8 train.py --audio /data/recordings --cache /nvme/mels
    python train.py --smoke            # generated recordings, a tiny CNN: under a minute on 2 CPUs
    torchrun --nproc_per_node=2 train.py --smoke     # 2 processes on CPU (gloo)

The plain template (`recipes template audio`) with an `Accelerator` doing the distributed
parts: the process group, DDP, mixed precision, `accelerator.backward`, batches moved to the
device, and checkpoints with `accelerator.save_state()` / `load_state()`. The loader goes
through `prepare_loader` (common/frameworks/accelerate_glue.py), never `accelerator.prepare`,
which would rebuild it as a plain DataLoader and lose its state: checkpoints hold the loader's
place, one JSON file per rank, and a resumed run starts at the first batch it had not trained
on, at once.

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
  - `LoaderMonitor`, as in the vision template.
  - Checkpoints: `accelerator.save_state` into `checkpoints/step-N`, marked complete once every
    rank wrote its files; a restart resumes the newest complete one.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache, pad_collate
from recipes.common import LengthBucketSampler, LoaderMonitor, make_loader
from recipes.common.frameworks.accelerate_glue import prepare_loader
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


def prepare_data(args, accelerator):
    """The spectrogram cache of chunked windows, its features computed by every rank's share."""
    chunk = 1.0 if args.smoke else CHUNK_SECONDS
    if args.smoke:
        args.audio = args.workdir / "audio"
        args.cache = args.workdir / "mels"
        if accelerator.is_main_process and not (args.audio / ".complete").exists():
            make_audio_files(args.audio, count=6, seconds=[4.0, 6.5, 3.2, 8.0, 5.1, 2.4], seed=0)
            (args.audio / ".complete").touch()
    accelerator.wait_for_everyone()
    windows = ChunkedAudioDataset(
        args.audio, chunk_seconds=chunk, sample_rate=SAMPLE_RATE, last_chunk="keep"
    )
    n_mels = 40 if args.smoke else 80
    return build_spectrogram_cache(
        windows, args.cache, n_mels=n_mels, distributed=accelerator.num_processes > 1
    ), n_mels


class Progress:
    """The step count, saved and loaded with the checkpoint (`register_for_checkpointing`)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def save_checkpoint(accelerator, workdir: Path, step: int, keep: int = 2) -> None:
    """`save_state` on every rank into checkpoints/step-N, marked complete once all ranks wrote."""
    folder = workdir / "checkpoints" / f"step-{step:09d}"
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (folder / "complete").touch()
        for old in sorted(p.parent for p in folder.parent.glob("step-*/complete"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(workdir: Path) -> Path | None:
    done = sorted(p.parent for p in (workdir / "checkpoints").glob("step-*/complete"))
    if not done:
        return None
    return done[-1]


def main(argv=None) -> None:
    from accelerate import Accelerator

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision="bf16" if cuda else "no"
    )  # cpu: gloo across processes
    rank = accelerator.process_index
    world = accelerator.num_processes
    args.workdir.mkdir(parents=True, exist_ok=True)
    cache, n_mels = prepare_data(args, accelerator)
    # built after the Accelerator: it reads the ranks from torch.distributed
    sampler = LengthBucketSampler(cache.lengths, max_tokens=args.max_frames, seed=0)
    loader = prepare_loader(
        accelerator,
        LoaderMonitor(make_loader(cache, batch_sampler=sampler, collate_fn=pad_collate)),
    )  # batches on the device
    model = build_model(n_mels, args.smoke)
    if world > 1 and cuda:  # batch statistics over every rank's windows
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    checkpoint = latest_checkpoint(args.workdir)
    if checkpoint is not None:  # resume: model, optimiser, random states, and the loader's place
        accelerator.load_state(str(checkpoint))
    log = None
    if args.log_samples:
        log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    for epoch in range(
        loader.epoch, args.epochs
    ):  # the loader's state says which epoch to continue
        loader.set_epoch(epoch)
        start = time.perf_counter()
        loss = None
        for batch in loader:
            mels = batch["inputs"].float().unsqueeze(1)  # [B, 1, n_mels, T]
            with accelerator.autocast():
                loss = torch.nn.functional.cross_entropy(model(mels), label_of(batch))
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            progress.step += 1
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
            if progress.step % args.checkpoint_every == 0:
                save_checkpoint(accelerator, args.workdir, progress.step)
            if args.stop_after is not None and progress.step >= args.stop_after:
                accelerator.wait_for_everyone()
                os._exit(0)  # a simulated crash: no clean-up, as a killed job
        if progress.step % args.checkpoint_every:  # the epoch's end (the next epoch starts afresh)
            save_checkpoint(accelerator, args.workdir, progress.step)
        if accelerator.is_main_process:
            summary = loader.summary()
            loss_text = "-"  # a resume at the epoch's end: no batch left
            if loss is not None:
                loss_text = f"{loss.item():.3f}"
            print(
                f"epoch {epoch}: {time.perf_counter() - start:.1f} s, loss {loss_text}, "
                f"data wait {summary['wait_fraction']:.0%}",
                flush=True,
            )
    if accelerator.is_main_process:
        print(loader.report())
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
