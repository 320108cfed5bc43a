"""`recipes template DOMAIN`: print a domain's training template, to copy and adapt (`> train.py`)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

DOMAINS = ("vision", "nlp", "audio")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", choices=DOMAINS, help="which template")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"recipes.{args.domain}.template")
    print(Path(module.__file__).read_text(), end="")
    return 0
