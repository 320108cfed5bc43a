"""The wheel holds only recipes/..., and bare domain imports are banned by ruff."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Builds the wheel from a copy of the sources, so the checkout gets no build/ folder."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("recipes", "common", "vision", "nlp", "audio"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    code = f"import setuptools.build_meta as b; print(b.build_wheel({str(out)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=src
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return out / result.stdout.strip().splitlines()[-1]


def test_wheel_holds_only_the_recipes_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if ".dist-info/" not in n]
    assert code, names
    assert all(n.startswith("recipes/") for n in code), [
        n for n in code if not n.startswith("recipes/")
    ]
    for domain in ("common", "vision", "nlp", "audio"):
        assert f"recipes/{domain}/__init__.py" in code
    assert "recipes/cli.py" in code
    assert not any(n.startswith("tests/") for n in names)


def test_ruff_bans_bare_domain_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import vision\nfrom common import make_loader\nfrom recipes.nlp import x\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--select",
            "TID251",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stdout.count("TID251") == 2, result.stdout


def test_the_repository_passes_ruff():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_s3fs_and_fsspec_come_from_one_release_family():
    """s3fs pins the fsspec it was released with; an old boto-based s3fs (0.4.x), which a
    resolver squeezed by moto's botocore once chose, is not what `loader-recipes[cloud]` installs.
    """
    import fsspec
    import s3fs

    s3fs_release = tuple(int(v) for v in s3fs.__version__.split(".")[:2])
    fsspec_release = tuple(int(v) for v in fsspec.__version__.split(".")[:2])
    assert s3fs_release == fsspec_release, (s3fs.__version__, fsspec.__version__)
    assert s3fs_release >= (2024, 2)
