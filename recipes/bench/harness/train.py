"""`recipes bench train`: loaders feeding a real training step, against the model alone.

Use when: deciding whether the input pipeline keeps the accelerator busy. A CPU micro-benchmark
hides what matters here: the main process also launches the step's kernels, the pin-memory
thread competes for it, and worker start-up delays the first step.
Cost: per domain, one resident-batch run of the model alone, then `--steps` training steps per
loader (the plain torch way, the recipe cold, the recipe warm), each step synchronised.
Adapt here: each domain's `train_setup` in the module `TRAIN_SETUPS` names (model, step,
loaders), which returns a `recipes.bench.harness.train_setup.TrainSetup`.
Trade-off: `--steps` short runs carry noise; each loader's first batch is reported apart and
excluded from the steady rate, whose data wait is the share of time spent in `next(loader)`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from recipes.bench.harness.bench_charts import Chart, slug, write_chart
from recipes.bench.harness.train_setup import TrainSetup
from recipes.common.tuning.monitor import LoaderMonitor, LoaderWarning

# Each domain's `train_setup(args, device)`, imported when that domain runs (each module imports
# its domain's library and models at its top).
TRAIN_SETUPS = {
    "vision": "recipes.bench.images.train_setup",
    "nlp": "recipes.bench.nlp",
    "audio": "recipes.bench.audio",
    "lm": "recipes.bench.lm",
}
DOMAINS = tuple(TRAIN_SETUPS)
# training steps per loader when `--steps` is left out, by whether the device is CUDA
DEFAULT_STEPS = {True: 60, False: 8}


@dataclass
class TrainRow:
    name: str
    rate: float
    of_model: float
    wait_fraction: float
    first_batch_s: float
    workers: int
    gpu_util: float | None
    steps: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", choices=(*DOMAINS, "all"), default="vision")
    parser.add_argument(
        "--model",
        default=None,
        help="vision: resnet50|resnet18|tiny; nlp: bert-small|tiny; "
        "audio: cnn|tiny; lm: gpt-small|tiny (default: the large one on CUDA, tiny on CPU)",
    )
    parser.add_argument(
        "--device", default=None, help="cuda, cpu, ... (default: cuda when available)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers for every loader (default: make_loader's choice, the same for the baseline)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per loader (default 60 GPU, 8 CPU)"
    )
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument(
        "--size", type=int, default=None, help="vision crop size (default 224 GPU, 96 CPU)"
    )
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        help="vision images generated (default 6400 GPU, 320 CPU)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="nlp texts generated (default 50000 GPU, 2000 CPU)",
    )
    parser.add_argument(
        "--autotune", action="store_true", help="add rows with autotuned workers (measured first)"
    )
    parser.add_argument(
        "--autotune-seconds", type=float, default=90.0, help="each autotune sweep's budget"
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="write the rows as JSON"
    )


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or _default_device())
    cuda = device.type == "cuda"
    steps = args.steps or DEFAULT_STEPS[cuda]
    domains = (args.domain,)
    if args.domain == "all":
        domains = DOMAINS
    results = {}
    for domain in domains:
        module = importlib.import_module(TRAIN_SETUPS[domain])
        setup = module.train_setup(args, device)
        plot = getattr(args, "plot", None)
        rows, alone = measure_setup(setup, device, steps, plot=plot, prefix=f"train-{domain}")
        heading = _print(domain, setup, rows, alone, device, steps)
        write_chart(
            Chart(
                f"train-{domain}",
                heading,
                f"{setup.unit}/s",
                ("model alone (batch resident on the device)", *(r.name for r in rows)),
                (alone, *(r.rate for r in rows)),
                ratio_format="{:.0%}",
            ),
            plot,
        )
        results[domain] = {
            "model_alone": alone,
            "unit": setup.unit,
            "model": setup.model,
            "rows": [asdict(r) for r in rows],
            "notes": setup.notes,
        }
    if args.json is not None:
        args.json.write_text(
            json.dumps({"device": _device_name(device), "steps": steps, **results}, indent=1)
        )
    return 0


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _share(rate: float, alone: float) -> float:
    """`rate` as a share of the model alone's (0 when the model alone was not measured)."""
    if alone:
        return rate / alone
    return 0.0


def measure_setup(
    setup: TrainSetup, device, steps: int, *, plot: Path | None = None, prefix: str = "train"
) -> tuple[list[TrainRow], float]:
    """The model alone, then each loader's row; with `plot`, each loader's run as a timeline
    chart `plot/<prefix>-<loader>-timeline.png` and `.svg` (`LoaderMonitor.plot`)."""
    before = model_alone(setup, device, steps)
    rows = []
    for name, loader, to_device in setup.loaders:
        timeline = None
        if plot is not None:
            timeline = Path(plot) / f"{prefix}-{slug(name, 56)}-timeline"
        rows.append(
            train_with(name, loader, to_device, setup, device, steps, before, timeline=timeline)
        )
    # measured again once the loaders ran (the allocator, cuDNN and the caches warm): the faster
    # of the two; a first measurement alone was found slower than the step fed by a loader
    alone = max(before, model_alone(setup, device, steps))
    for row in rows:
        row.of_model = _share(row.rate, alone)
    return rows, alone


def model_alone(setup: TrainSetup, device, steps: int) -> float:
    """Samples per second of the step on one batch already on the device: the best of two
    runs of `steps` steps (at least 10), after 5 of warm-up."""
    for _ in range(5):  # warm-up: cuDNN autotuning, allocator growth
        setup.step(setup.resident)
    _sync(device)
    return max(_steps_rate(setup, device, max(10, steps)) for _ in range(2))


def _steps_rate(setup: TrainSetup, device, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        setup.step(setup.resident)
        _sync(device)
    return setup.count(setup.resident) * steps / (time.perf_counter() - start)


def train_with(
    name: str,
    loader,
    to_device,
    setup: TrainSetup,
    device,
    steps: int,
    alone: float,
    *,
    timeline: Path | None = None,
) -> TrainRow:
    """`steps` steps fed by `loader` (epochs repeat as needed), after one first step that is
    timed apart; the data wait and GPU utilisation come from `LoaderMonitor`, whose timeline
    is drawn to `timeline` + .png and .svg when given."""
    monitor = LoaderMonitor(loader, sample_seconds=1.0)
    done = 0
    counted = 0
    start = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LoaderWarning)  # the table says it
        while done < steps + 1:
            for batch in monitor:
                on_device = to_device(batch)
                setup.step(on_device)
                _sync(device)
                if start is None:  # the first step: worker start-up and warm-up, reported apart
                    start = time.perf_counter()
                else:
                    counted += setup.count(on_device)
                done += 1
                if done >= steps + 1:
                    break
    rate = counted / (time.perf_counter() - start)
    if timeline is not None:
        for suffix in (".png", ".svg"):
            monitor.plot(
                timeline.with_name(timeline.name + suffix),
                title=f"{name}: {setup.model} on {_device_name(device)}",
            )
    summary = monitor.summary()
    return TrainRow(
        name,
        rate,
        _share(rate, alone),
        summary["wait_fraction"],
        monitor.epochs[0]["first_batch_s"],
        getattr(loader, "num_workers", 0),
        summary.get("gpu_util"),
        done,
    )


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _print(
    domain: str, setup: TrainSetup, rows: list[TrainRow], alone: float, device, steps: int
) -> str:
    """Prints the domain's table; returns its heading."""
    heading = (
        f"train/{domain}: {setup.model} on {_device_name(device)} ({os.cpu_count()} CPUs), "
        f"{steps} steps per loader"
    )
    print(f"\n## {heading}\n")
    print(f"model alone (batch resident on the device): {alone:,.1f} {setup.unit}/s\n")
    print(
        f"| loader | workers | {setup.unit}/s | of model alone | data wait | first batch (s) | GPU "
        "util |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gpu = "-"
        if r.gpu_util is not None:
            gpu = f"{r.gpu_util:.0f}%"
        print(
            f"| {r.name} | {r.workers} | {r.rate:,.1f} | {r.of_model:.0%} | {r.wait_fraction:.0%} "
            f"| {r.first_batch_s:.2f} | {gpu} |"
        )
    for note in setup.notes:
        print(f"\n{note}")
    return heading
