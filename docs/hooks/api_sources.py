"""MkDocs hook: the sources mkdocstrings reads, laid out as they are imported.

The domains live in the repository's `common/`, `vision/`, `nlp/` and `audio/` folders and are
installed as `recipes.common`, ... (setuptools `package-dir`). Griffe reads sources by their
place on disk, where `recipes/` holds none of them, so before each build this hook copies
`recipes/__init__.py` and the four domains into a temporary `recipes/` package and puts it first
on the handler's search paths. Nothing is imported: the reference is read from the sources.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

DOMAINS = ("common", "vision", "nlp", "audio")
_staged: list[tempfile.TemporaryDirectory] = []


def stage_sources(root: Path, target: Path) -> Path:
    """Copies the `recipes` package as installed (its `__init__.py` and the domains) under
    `target`; returns the folder to search."""
    package = target / "recipes"
    package.mkdir(parents=True)
    shutil.copy2(root / "recipes" / "__init__.py", package / "__init__.py")
    for domain in DOMAINS:
        shutil.copytree(
            root / domain, package / domain, ignore=shutil.ignore_patterns("__pycache__")
        )
    return target


@event_priority(100)  # before mkdocstrings' own on_config, which creates the handler
def on_config(config, **kwargs):
    root = Path(config.config_file_path).resolve().parent
    folder = tempfile.TemporaryDirectory(prefix="recipes-api-")
    _staged.append(folder)
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(stage_sources(root, Path(folder.name)))]
    return config


def on_shutdown(**kwargs):
    while _staged:
        _staged.pop().cleanup()
