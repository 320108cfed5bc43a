"""The `recipes` command line: `doctor`, `cache`, `shards`, `template`, `tune`, `bench` (and `python
-m recipes`).

A command's module is imported only when that command runs (`COMMANDS`, `BENCHES`): the modules
import the library (and torch) at their top, and `recipes --help` and its errors stay free of
torch. A bench domain's one-line help is its module docstring's first line, read from the source.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from recipes import __version__

# Commands: the module that adds its arguments and runs it, and its one-line help.
COMMANDS = {
    "doctor": ("recipes.commands.doctor", "this machine's data-loading report and settings"),
    "cache": ("recipes.commands.cache_cmd", "build a domain's preprocessed cache"),
    "shards": (
        "recipes.commands.shards_cmd",
        "write a folder or corpus as WebDataset tar or Parquet shards",
    ),
    "template": (
        "recipes.commands.template_cmd",
        "print a training template to copy (recipes template vision > train.py)",
    ),
    "tune": (
        "recipes.commands.tune_cmd",
        "measure num_workers and prefetch_factor for your dataset",
    ),
}
BENCH_HELP = "measure the recipes against plain torch baselines, in one run"
# Benchmarks by domain, run in this order by a bare `recipes bench`.
BENCHES = {
    "common": "recipes.bench.common",
    "vision": "recipes.bench.vision",
    "nlp": "recipes.bench.nlp",
    "audio": "recipes.bench.audio",
    "remote": "recipes.bench.remote",
    "shards": "recipes.bench.shards",
    "verify": "recipes.bench.verify_cost",
    "text-stream": "recipes.bench.text_stream",
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
PLOT_HELP = (
    "write each table as a bar chart, DIR/<table>.png and .svg (train: also each run's "
    'timeline); needs matplotlib: pip install "loader-recipes[plot]"'
)


class _Parser(argparse.ArgumentParser):
    """Errors as one line (`recipes: error: ...`) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def chosen(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The first of `argv`'s words that names one of `names` (the command, then the domain)."""
    for word in argv:
        if word in names:
            return word
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `argv`: its command's arguments (and its bench domain's) are added, the
    other commands are listed only. Without `argv`, every command's arguments are added."""
    command = None if argv is None else chosen(argv, [*COMMANDS, "bench"])
    parser = _Parser(prog="recipes", description="Production-grade PyTorch data-loading recipes.")
    parser.add_argument("--version", action="version", version=f"recipes {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if argv is None or name == command:
            importlib.import_module(module_name).add_arguments(sub)
    bench = commands.add_parser("bench", help=BENCH_HELP)
    bench.add_argument("--plot", type=Path, default=None, metavar="DIR", help=PLOT_HELP)
    domain = None
    if argv is not None and command == "bench":
        domain = chosen(argv[list(argv).index("bench") + 1 :], list(BENCHES))
    add_bench_domains(bench, everything=argv is None, domain=domain)
    bench.set_defaults(handler=_bench_all)
    return parser


def add_bench_domains(
    bench: argparse.ArgumentParser, *, everything: bool, domain: str | None
) -> None:
    domains = bench.add_subparsers(dest="domain", metavar="DOMAIN")
    for name, module_name in BENCHES.items():
        sub = domains.add_parser(name, help=first_docstring_line(module_name))
        # SUPPRESS: `recipes bench --plot DIR vision` keeps the DIR given before the domain
        sub.add_argument(
            "--plot", type=Path, default=argparse.SUPPRESS, metavar="DIR", help=PLOT_HELP
        )
        if everything or name == domain:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(handler=checked(module.run))


def first_docstring_line(module_name: str) -> str:
    """A module's docstring's first line, read from its source without importing it."""
    spec = importlib.util.find_spec(module_name)
    source = Path(spec.origin).read_text()
    return (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]


def checked(run):
    """`run`, after checking that `--plot`'s charts can be written (before minutes of measuring)."""

    def checked_run(args: argparse.Namespace) -> int:
        charts = importlib.import_module("recipes.bench.harness.bench_charts")
        charts.prepare(args.plot)
        return run(args)

    return checked_run


def _bench_all(args: argparse.Namespace) -> int:
    """`recipes bench` without a domain: every domain with its defaults, each in a fresh
    process so one benchmark's memory and threads do not colour the next one's figures."""
    charts = importlib.import_module("recipes.bench.harness.bench_charts")
    charts.prepare(args.plot)
    status = 0
    for command in bench_commands(args.plot):
        status = max(status, subprocess.run(command, check=False).returncode)
    return status


def bench_commands(plot: Path | None = None) -> list[list[str]]:
    """The commands a bare `recipes bench` runs: every domain but those run on their own
    (`recipes bench train`, `lightning`, `hf`), each passed `--plot` when given."""
    extra = []
    if plot is not None:
        extra = ["--plot", str(plot)]
    return [
        [sys.executable, "-m", "recipes", "bench", name, *extra]
        for name in BENCHES
        if name not in _ON_THEIR_OWN
    ]


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser(argv).parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError, ImportError) as error:
        print(f"recipes {args.command}: error: {error}", file=sys.stderr)
        return 1
