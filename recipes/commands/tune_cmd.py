"""`recipes tune MODULE:FACTORY`: measure loader settings for your dataset and store them.

`FACTORY` is a function (or class) in `MODULE` (importable from the current folder) that takes
no arguments and returns a Dataset. `--step MODULE:FN` names your training step (called with
each batch, as the loop would): the trials run beside it, thread paths included, and the
path that feeds it for the least is what `make_loader` takes from then on. The table of trials is
printed, the result is stored so that `make_loader` on this machine reuses it, and `--json OUT`
writes it as JSON too."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from recipes.common.tuning.autotune import autotune

_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "factory", metavar="MODULE:FACTORY", help="e.g. train:make_dataset (returns a Dataset)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--collate", metavar="MODULE:FN", default=None, help="the loader's collate_fn"
    )
    step = parser.add_mutually_exclusive_group()
    step.add_argument(
        "--step",
        metavar="MODULE:FN",
        default=None,
        help="your training step, called with each batch (e.g. train:step)",
    )
    step.add_argument(
        "--step-ms", type=float, default=0.0, help="simulated training step per batch (ms)"
    )
    parser.add_argument(
        "--memory-budget", type=_bytes, default=None, help="peak loader memory, e.g. 8G"
    )
    parser.add_argument("--max-seconds", type=float, default=120.0, help="the whole sweep's budget")
    parser.add_argument("--seconds-per-trial", type=float, default=2.0)
    parser.add_argument("--max-workers", type=int, default=None, help="largest worker count tried")
    parser.add_argument(
        "--no-store", action="store_true", help="do not store the result for make_loader"
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="write the result as JSON"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    factory = _load(args.factory)  # a wrong MODULE:NAME is reported before the dataset is built
    collate = _load_if_named(args.collate)
    step = _load_if_named(args.step)
    if step is not None and not callable(step):
        raise ValueError(
            f"--step {args.step}: {type(step).__name__} is not callable; name a function of one "
            "batch."
        )
    dataset = factory()
    result = autotune(
        dataset,
        batch_size=args.batch_size,
        collate_fn=collate,
        step=step,
        step_seconds=args.step_ms / 1000,
        memory_budget=args.memory_budget,
        seconds_per_trial=args.seconds_per_trial,
        max_seconds=args.max_seconds,
        max_workers=args.max_workers,
        store=not args.no_store,
        log=lambda line: print(line, file=sys.stderr),
    )
    beside = f"{args.step_ms:g} ms"
    if step is not None:
        beside = args.step
    print(
        f"\n## tune: {type(dataset).__name__} ({args.factory}), batch {args.batch_size}, step "
        f"{beside}\n"
    )
    print(result.table())
    print(f"\nmake_loader(dataset, **{dict(result)!r})")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"settings": dict(result), "reason": result.reason, "trials": result.trials},
                indent=1,
            )
        )
    return 0


def _load_if_named(spec: str | None):
    """`_load(spec)` when `spec` names something; None when the option was left out."""
    if not spec:
        return None
    return _load(spec)


def _load(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:NAME (e.g. train:make_dataset), but got {spec!r}.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} ({module.__file__}) has no {attr!r}.") from None


def _bytes(text: str) -> int:
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = value[-1:] if value[-1:] in _SUFFIXES and not value[-1:].isdigit() else ""
    try:
        number = float(value[: len(value) - len(suffix)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected bytes like 8G or 512M, but got {text!r}"
        ) from None
    return int(number * _SUFFIXES[suffix])
