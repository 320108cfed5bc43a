"""`recipes template DOMAIN [--framework F]`: print a domain's training template, to copy and adapt
(`> train.py`).

`--framework plain` (the default) prints `recipes.<domain>.template` (a training loop of its
own); `lightning` and `accelerate` print `recipes.<domain>.template_<framework>`.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

DOMAINS = ("vision", "nlp", "audio")
FRAMEWORKS = ("plain", "lightning", "accelerate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", choices=DOMAINS, help="which template")
    parser.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default="plain",
        help="the training loop: our own (plain), Lightning's, or Accelerate's",
    )
    parser.set_defaults(handler=run)


def template_module(domain: str, framework: str = "plain") -> str:
    """The module whose source is the template of `domain` for `framework`."""
    if framework == "plain":
        return f"recipes.{domain}.template"
    return f"recipes.{domain}.template_{framework}"


def run(args: argparse.Namespace) -> int:
    name = template_module(args.domain, getattr(args, "framework", "plain"))
    spec = importlib.util.find_spec(
        name
    )  # the source only: a template imports its framework when run
    if spec is None or spec.origin is None:
        raise SystemExit(
            f"no template {name}: this recipes version has no {args.framework} template for "
            f"{args.domain}"
        )
    print(Path(spec.origin).read_text(), end="")
    return 0
