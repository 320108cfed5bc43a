"""The `recipes` command line: `doctor`, `cache`, `shards`, `template`, `tune`, `bench` (and `python
-m recipes`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from recipes import __version__

# Benchmarks by domain, run in this order by a bare `recipes bench`.
BENCHES = {
    "common": "recipes.bench.common",
    "vision": "recipes.bench.vision",
    "nlp": "recipes.bench.nlp",
    "audio": "recipes.bench.audio",
    "remote": "recipes.bench.remote",
    "shards": "recipes.bench.shards",
    "verify": "recipes.bench.verify_cost",
    "lightning": "recipes.bench.frameworks.lightning_loop",
    "hf": "recipes.bench.frameworks.hf_loops",
    "train": "recipes.bench.harness.train",
    "nodes": "recipes.bench.nodes",
    "step": "recipes.bench.harness.beside_step",
}
# Run on their own, not by a bare `recipes bench`: a training step per loader, a framework's loop
# (their extras: loader-recipes[lightning], loader-recipes[accelerate]), or torchrun launches of
# simulated nodes (minutes), or each path beside a simulated step (minutes).
_ON_THEIR_OWN = ("train", "lightning", "hf", "nodes", "step")


class _Parser(argparse.ArgumentParser):
    """Errors as one line (`recipes: error: ...`) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recipes", description="Production-grade PyTorch data-loading recipes.")
    parser.add_argument("--version", action="version", version=f"recipes {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    doctor = commands.add_parser("doctor", help="this machine's data-loading report and settings")
    from recipes import doctor as doctor_module

    doctor_module.add_arguments(doctor)
    doctor.set_defaults(handler=doctor_module.run)

    cache = commands.add_parser("cache", help="build a domain's preprocessed cache")
    from recipes import cache_cmd

    cache_cmd.add_arguments(cache)

    shards = commands.add_parser(
        "shards", help="write a folder or corpus as WebDataset tar or Parquet shards"
    )
    from recipes import shards_cmd

    shards_cmd.add_arguments(shards)

    template = commands.add_parser(
        "template", help="print a training template to copy (recipes template vision > train.py)"
    )
    from recipes import template_cmd

    template_cmd.add_arguments(template)

    tune = commands.add_parser(
        "tune", help="measure num_workers and prefetch_factor for your dataset"
    )
    from recipes import tune_cmd

    tune_cmd.add_arguments(tune)

    bench = commands.add_parser(
        "bench", help="measure the recipes against plain torch baselines, in one run"
    )
    plot_help = (
        "write each table as a bar chart, DIR/<table>.png and .svg (train: also each run's "
        'timeline); needs matplotlib: pip install "loader-recipes[plot]"'
    )
    bench.add_argument("--plot", type=Path, default=None, metavar="DIR", help=plot_help)
    domains = bench.add_subparsers(dest="domain", metavar="DOMAIN")
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        sub = domains.add_parser(name, help=(module.__doc__ or "").splitlines()[0])
        module.add_arguments(sub)
        # SUPPRESS: `recipes bench --plot DIR vision` keeps the DIR given before the domain
        sub.add_argument(
            "--plot", type=Path, default=argparse.SUPPRESS, metavar="DIR", help=plot_help
        )
        sub.set_defaults(handler=_checked(module.run))
    bench.set_defaults(handler=_checked(_bench_all))
    return parser


def _checked(run):
    """`run`, after checking that `--plot`'s charts can be written (before minutes of measuring)."""

    def checked(args: argparse.Namespace) -> int:
        from recipes.bench.harness.bench_charts import prepare

        prepare(args.plot)
        return run(args)

    return checked


def _bench_all(args: argparse.Namespace) -> int:
    """`recipes bench` without a domain: every domain with its defaults, each in a fresh
    process so one benchmark's memory and threads do not colour the next one's figures."""
    import subprocess

    status = 0
    for command in bench_commands(args.plot):
        status = max(status, subprocess.run(command, check=False).returncode)
    return status


def bench_commands(plot: Path | None = None) -> list[list[str]]:
    """The commands a bare `recipes bench` runs: every domain but those run on their own
    (`recipes bench train`, `lightning`, `hf`), each passed `--plot` when given."""
    extra = [] if plot is None else ["--plot", str(plot)]
    return [
        [sys.executable, "-m", "recipes", "bench", name, *extra]
        for name in BENCHES
        if name not in _ON_THEIR_OWN
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError, ImportError) as error:
        print(f"recipes {args.command}: error: {error}", file=sys.stderr)
        return 1
