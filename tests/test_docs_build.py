"""The documentation site builds, and the README stays a front page (issue 32).

`mkdocs build --strict` fails on a broken link or anchor, a page left out of the nav and an API
reference mkdocstrings cannot collect; it takes several seconds (the slow tier). The README's
checks are reads of one file (the default tier).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\((?!https?://|mailto:|#)(?P<target>[^)\s#]+)(?:#[^)\s]*)?\)")


@pytest.mark.slow
def test_the_site_builds_strict_with_every_exported_name_in_its_reference(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import recipes.audio
    import recipes.common
    import recipes.nlp
    import recipes.vision

    for domain in (recipes.common, recipes.vision, recipes.nlp, recipes.audio):
        page = (site / "reference" / domain.__name__.split(".")[1] / "index.html").read_text()
        missing = [name for name in domain.__all__ if f'id="{domain.__name__}.{name}"' not in page]
        assert not missing, f"{domain.__name__}: not in the API reference: {missing}"


def test_the_readme_is_a_front_page_under_15_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size < 15 * 1024, f"README.md is {size:,} bytes: move what the docs explain into docs/"


def test_the_readmes_relative_links_reach_files():
    """GitHub renders the README outside the site: its links into docs/ are checked here."""
    text = (ROOT / "README.md").read_text()
    broken = [m["target"] for m in LINK.finditer(text) if not (ROOT / m["target"]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def test_the_docs_extra_holds_what_the_build_needs_and_dev_installs_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {
        re.split(r"[<>=\[;\s]", requirement, maxsplit=1)[0].lower()
        for requirement in extras["docs"]
    }
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= names, extras["docs"]
    assert any(r.startswith("mkdocstrings[python]") for r in extras["docs"]), extras["docs"]
    assert "loader-recipes[docs]" in extras["dev"], extras["dev"]
