"""`recipes bench step`: each loading path beside a training step that holds the GIL for part of it.

Use when: choosing the path for a training loop (`make_loader(..., path=)`), or checking that
`make_loader`'s default keeps its speed when the loop itself needs the GIL. A loader measured
alone hides this: an eager PyTorch step spends milliseconds of Python per step launching
kernels and stepping the optimizer, and threads of the same process wait for the GIL then.
Cost: the photographic set (`--images`), its decoded cache built once, then per path one run
alone and one beside each step; `--batches` batches per run after 3 of warm-up.
Adapt here: `--gil` (ms of GIL per step), `--images`, `--size`, `--batch-size`, `--epoch-batches`.
Trade-off: the step is simulated, so that it is the same on every machine: L ms of pure
Python holding the GIL, then the rest of the step asleep with the GIL released (the device
computing), the whole step as long as the thread path takes per batch alone (the balanced
case, where any loss shows). "Of ideal" is the rate beside the step against the slower of the
step alone and the thread path alone (the in-process thread path: the fastest loader here).
Beside the longest step, the same CPU time is also spent off the GIL: the gap left there is the
cores the step takes from the loader (on 2 cores, most of one), which no path wins back. Each
figure beside a step is the best of two rounds, in turns.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass

from recipes.bench.harness.workers import usable_cpus
from recipes.bench.images.data import ensure_data
from recipes.common import make_loader
from recipes.vision import ImageFolderFast, build_image_cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--images", type=int, default=720, help="photographs in the set (default 720)"
    )
    parser.add_argument("--size", type=int, default=224, help="train crop size (default 224)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--batches", type=int, default=150, help="batches timed per run (default 150)"
    )
    parser.add_argument(
        "--gil", default="0,2,5", help="ms of GIL held per step, comma-separated (default 0,2,5)"
    )
    parser.add_argument(
        "--epoch-batches",
        type=int,
        default=None,
        help="epochs of this many batches, drawn with replacement from the set (default: the set's "
        "own epochs); a long epoch leaves out the drain at each epoch's end",
    )


@dataclass
class StepRow:
    path: str
    gil_ms: float
    rate: float
    alone: float
    of_ideal: float
    held: bool = True  # the step's CPU time holds the GIL (False: the same CPU off the GIL)
    ceiling: float = (
        1.0  # of ideal: the cores over the loader's CPU alone and the step's together (an estimate)
    )


class SimulatedStep:
    """`gil_s` of pure Python holding the GIL (CPU time of the loop's thread: the same work
    whatever else wants the GIL), then sleeping (GIL released) to `total_s`. With
    `held=False` the same CPU time is spent off the GIL (hashing 64 KiB blocks, which CPython
    does with the GIL released): what the step's CPU alone costs the loader, without the GIL."""

    _BLOCK = bytes(64 * 1024)

    def __init__(self, gil_s: float, total_s: float, held: bool = True):
        self.gil_s = gil_s
        self.total_s = total_s
        self.held = held

    def __call__(self, batch) -> None:
        import hashlib

        start = time.perf_counter()
        end = (
            time.thread_time() + self.gil_s
        )  # a fixed amount of work: this thread's CPU time, which
        while (
            time.thread_time() < end
        ):  # stops while another thread holds the GIL (a wall clock would not)
            if not self.held:  # the loop's Python, above: kernel launches, the optimizer step
                hashlib.sha256(self._BLOCK)
        left = self.total_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)


def rate(loader, step, batches: int, batch_size: int, warmup: int = 3) -> float:
    """Samples per second over `batches` batches of `loader` (epochs repeat as needed), each
    followed by `step(batch)` when given, after `warmup` batches."""
    done = 0
    start = None
    while True:
        for batch in loader:
            if step is not None:
                step(batch)
            done += 1
            if done == warmup:
                start = time.perf_counter()
            elif done == warmup + batches:
                return batches * batch_size / (time.perf_counter() - start)


def step_alone(step, batch, batches: int, batch_size: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        step(batch)
    return batches * batch_size / (time.perf_counter() - start)


def loaders(dataset, batch_size: int, epoch_batches: int | None = None):
    """(name, loader) per path: make_loader's default, each path it can take; with
    `epoch_batches`, epochs of that many batches drawn with replacement."""
    import torch
    from torch.utils.data import RandomSampler

    def order():
        if epoch_batches is None:
            return {"shuffle": True}
        return {
            "sampler": RandomSampler(
                dataset,
                replacement=True,
                num_samples=epoch_batches * batch_size,
                generator=torch.Generator().manual_seed(0),
            )
        }

    return [
        ("make_loader default", make_loader(dataset, batch_size=batch_size, **order())),
        (
            "isolated threads (path='isolated')",
            make_loader(dataset, batch_size=batch_size, **order(), path="isolated"),
        ),
        (
            "in-process threads (path='threads')",
            make_loader(dataset, batch_size=batch_size, **order(), path="threads"),
        ),
        (
            "2 worker processes (path='workers')",
            make_loader(
                dataset, batch_size=batch_size, **order(), num_workers=2, persistent_workers=True
            ),
        ),
    ]


def measure(
    dataset, *, batch_size: int, batches: int, gil_ms: list[float], epoch_batches: int | None = None
) -> tuple[list[StepRow], float, dict]:
    """Rows of every path beside every step; (rows, step time in s, the paths' rates alone)."""
    made = loaders(dataset, batch_size, epoch_batches)
    alone = {name: rate(loader, None, batches, batch_size) for name, loader in made}
    cpu_per_batch = 0.0
    for name, loader in made:  # a second round, in turns: the best of two
        cpu = time.process_time()
        alone[name] = max(alone[name], rate(loader, None, batches, batch_size))
        if name == "in-process threads (path='threads')":  # all its work is this process's CPU time
            cpu_per_batch = (time.process_time() - cpu) / (batches + 3)
    threads_alone = alone["in-process threads (path='threads')"]
    cores = usable_cpus()
    total_s = (
        batch_size / threads_alone
    )  # balanced: the step alone as fast as the thread path alone
    resident = next(iter(made[2][1]))
    rows = []
    for gil, held in [(g, True) for g in gil_ms] + [(max(gil_ms), False)] * (max(gil_ms) > 0):
        step = SimulatedStep(gil / 1000, total_s, held=held)
        step_rate = step_alone(step, resident, batches, batch_size)
        ideal = min(threads_alone, step_rate)
        got = {name: 0.0 for name, _ in made}
        for _ in range(2):  # the best of two rounds, in turns
            for name, loader in made:
                got[name] = max(got[name], rate(loader, step, batches, batch_size))
        # The cores bound any path: a batch costs the loader's CPU and the step's, whoever holds the
        # GIL. An estimate: the loader's CPU is measured alone, where its threads sleep and wake
        # more often than on saturated cores (a path that yields the cores to the step can pass it
        # by a few points).
        ceiling = min(1.0, cores * batch_size / (cpu_per_batch + gil / 1000) / ideal)
        rows += [
            StepRow(name, gil, got[name], step_rate, got[name] / ideal, held, ceiling)
            for name, _ in made
        ]
    for _, loader in made:
        loader.close()
    return rows, total_s, alone


def run(args: argparse.Namespace) -> int:
    gil_ms = [float(v) for v in args.gil.split(",")]
    root = ensure_data(args.images, kind="photos")
    with tempfile.TemporaryDirectory(prefix="recipes-bench-step-") as cache:
        dataset = ImageFolderFast(root, size=args.size, train=True)
        build_image_cache(dataset, cache, progress=False)
        rows, total_s, alone = measure(
            dataset,
            batch_size=args.batch_size,
            batches=args.batches,
            gil_ms=gil_ms,
            epoch_batches=args.epoch_batches,
        )
        reason = loaders(dataset, args.batch_size, args.epoch_batches)[0][1].recipe.reasons["path"]
    epochs = (
        f"epochs of {args.epoch_batches} batches drawn with replacement"
        if args.epoch_batches
        else f"epochs of {-(-args.images // args.batch_size)} batches"
    )
    print(
        f"\n## step: each path beside a simulated training step ({args.images} photographs, warm "
        f"cache, train crops {args.size} px, batch {args.batch_size}, {epochs}, a "
        f"{total_s * 1000:.1f} ms step)\n"
    )
    print("| path | alone (img/s) |\n|---|---:|")
    for name, value in alone.items():
        print(f"| {name} | {value:,.0f} |")
    print(
        "\n| the step's CPU per step | path | beside the step (img/s) | step alone (img/s) | of "
        "ideal | CPU ceiling (est.) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        what = (
            f"{r.gil_ms:g} ms of {total_s * 1000:.1f}, GIL held"
            if r.held
            else f"{r.gil_ms:g} ms of {total_s * 1000:.1f}, off the GIL (the CPU alone)"
        )
        print(
            f"| {what} | {r.path} | {r.rate:,.0f} | {r.alone:,.0f} | {r.of_ideal:.0%} | "
            f"{r.ceiling:.0%} |"
        )
    print(
        "\nThe last rows spend the step's CPU with the GIL released: what is left between them "
        "and 100% is the cores the step takes from the loader, not the GIL. The CPU ceiling "
        "estimates what the cores allow any path, of ideal: cores x batch / (the thread path's "
        "CPU per batch alone + the step's CPU); measured alone, the loader's CPU per batch "
        "includes wake-ups that saturated cores spare it, so a path can pass the estimate by a "
        "few points."
    )
    print(f"\nmake_loader's default: {reason}")
    return 0
