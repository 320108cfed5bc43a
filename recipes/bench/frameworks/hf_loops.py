"""`recipes bench hf`: our loaders inside Hugging Face Accelerate's loop and the transformers
Trainer's.

Use when: checking what a restart costs in each framework (the time from resuming to the first
batch, at several positions in an epoch: our loaders resume at once, the frameworks' own
resume skips the batches already trained on) and what each framework's loop costs our
loader's throughput against a plain loop over the same loader, in the same run.
Cost: on 2 CPUs about 10 minutes with the defaults (the transformers import alone is 8-20 s):
4-5 minutes per table (`--part`).
Adapt here: `--batches` (the epoch), `--item-us` (CPU time to make one item: a decode's
stand-in), `--batch-size`, `--workers`, `--positions`.
Trade-off: a tiny model on CPU, so the figures are the loops' and the loader's, not a model's.
A Trainer checkpoint "at step p" is made by training one step and setting `global_step` to p
in its `trainer_state.json` (the Trainer reads only that to decide what to skip), with the
loader state a loader has after p batches (read from the same dataset at zero cost per item);
the timed resume then reads with the full cost. Accelerate's rows time the loader alone:
`load_state_dict` + `iter` + the first batch for ours, `skip_first_batches` + `iter` + the
first batch for accelerate's prepared DataLoader (a map-style dataset skips indices only; an
iterable one is read and discarded).
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import warnings
from pathlib import Path

# The measurements import transformers (8-20 s) and accelerate's glue at their top, and both
# frameworks are optional: the module is imported when the command runs, as `recipes/cli.py`
# imports a command's module, so that `recipes bench hf --help` needs neither.
RUNS = "recipes.bench.frameworks.hf_loop_runs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=4000, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--item-us", type=float, default=150.0, help="CPU time to make one item, in microseconds"
    )
    parser.add_argument(
        "--loop-item-us",
        type=float,
        default=400.0,
        help="throughput: CPU time per item (the loader, in its workers, is the bottleneck)",
    )
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    parser.add_argument(
        "--positions", default="0.1,0.5,0.9", help="resume positions, as fractions of the epoch"
    )
    parser.add_argument(
        "--loop-batches", type=int, default=600, help="batches per epoch of the throughput loops"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="throughput: epochs per loop, best taken, in turns"
    )
    parser.add_argument(
        "--part",
        choices=["all", "resume", "loops"],
        default="all",
        help="only the resume table, or only the throughput table",
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    # the first two columns name the row, the others are figures (right-aligned)
    aligns = ["---", "---", *["---:"] * (len(header) - 2)]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(aligns) + "|",
    ]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def run(args: argparse.Namespace) -> int:
    import torch
    from accelerate import Accelerator
    from transformers.utils import logging as hf_logging

    runs = importlib.import_module(RUNS)

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    with tempfile.TemporaryDirectory(prefix="recipes-hf-loops-") as tmp:
        folder = Path(tmp)
        if args.part in ("all", "resume"):
            resumed = runs.resume_rows(accelerator, args, folder)
            print(
                "\n## hf_loops: time to the first batch after a resume (s), an epoch of "
                f"{args.batches:,} batches of {args.batch_size}, {args.item_us:g} us of CPU per "
                f"item, {args.workers} workers\n"
            )
            print(
                _table(
                    [
                        "data",
                        "resumed after",
                        "recipes + accelerate",
                        "accelerate `skip_first_batches`",
                        "recipes + Trainer",
                        "Trainer's own data skip",
                    ],
                    resumed,
                )
            )
        if args.part in ("all", "loops"):
            loops = runs.throughput_rows(accelerator, args, folder)
            direct, wrapped = runs.glue_cost(accelerator, args)
            print(
                f"\n## hf_loops: one epoch of {args.loop_batches:,} batches of {args.batch_size} "
                f"({args.loop_item_us:g} us per item, {args.workers} workers), the same loader in "
                f"each loop, best of {args.repeats} in turns\n"
            )
            print(
                _table(
                    [
                        "the loader's items",
                        "loop",
                        "samples/s",
                        "vs the plain loop",
                        "the loop's own time per step (instant items, ms)",
                    ],
                    loops,
                )
            )
            print(
                f"\nThe glue's own cost: iterating the loader directly {direct:.0f} us per batch, "
                f"through AcceleratedLoader {wrapped:.0f} us per batch (instant items, no workers, "
                "best of 3)."
            )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
