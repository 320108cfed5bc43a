"""The first command works: `pip install -e ".[dev]" -c constraints.txt` resolves at once.

constraints.txt (written by .ci/refresh-constraints) pins one consistent set of releases for every
extra on every supported platform and Python; the README and .ci/run install with it. Without it
pip backtracks through the extras' ranges (s3fs <-> fsspec, aiobotocore <-> botocore <-> moto's
boto3) for half an hour and more (issue 36).
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DIST = "loader-recipes"
INSTALL = 'pip install -e ".[dev]" -c constraints.txt'

# The environments the lock promises: each supported Python on the platforms users train on.
PLATFORMS = [
    {
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    },
    {
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "aarch64",
        "os_name": "posix",
    },
    {
        "sys_platform": "darwin",
        "platform_system": "Darwin",
        "platform_machine": "arm64",
        "os_name": "posix",
    },
    {
        "sys_platform": "win32",
        "platform_system": "Windows",
        "platform_machine": "AMD64",
        "os_name": "nt",
    },
]
PYTHONS = ["3.10.14", "3.11.7", "3.12.8", "3.13.1"]


def environments():
    for platform in PLATFORMS:
        for full in PYTHONS:
            env = dict(
                platform,
                python_version=full.rsplit(".", 1)[0],
                python_full_version=full,
                implementation_name="cpython",
                platform_python_implementation="CPython",
                extra="",
            )
            yield f"{platform['sys_platform']}-{platform['platform_machine']}-py{full}", env


def pins():
    """{canonical name: [(version, marker or None)]} from constraints.txt."""
    out = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", (
            f"constraints.txt:{number}: not a pin: {line!r}"
        )
        assert not req.extras, (
            f"constraints.txt:{number}: pip refuses extras in a constraint: {line!r}"
        )
        out.setdefault(canonicalize_name(req.name), []).append(
            (Version(specs[0].version), req.marker)
        )
    return out


def project_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    for extra, lines in groups.items():
        for line in lines:
            req = Requirement(line)
            if (
                canonicalize_name(req.name) != DIST
            ):  # dev names the other extras by the project's own name
                yield extra, req


def pin_for(name, env, table):
    chosen = [v for v, marker in table.get(name, []) if marker is None or marker.evaluate(env)]
    return chosen


def test_the_distribution_has_a_name_of_its_own_and_the_import_name_stays():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["scripts"]["recipes"] == "recipes.cli:main"
    readme = (ROOT / "README.md").read_text()
    assert f"pip install {DIST}" in readme
    # Every install hint the library prints names the distribution users can install.
    stale = []
    for folder in ("recipes", "common", "vision", "nlp", "audio", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and re.search(
                r"pip install ['\"]?recipes\[", path.read_text()
            ):
                stale.append(str(path.relative_to(ROOT)))
    assert not stale, f"install hints that name the unrelated `recipes` distribution: {stale}"


def test_readme_ci_and_getting_started_install_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert first_block.splitlines()[0].startswith(INSTALL), first_block
    assert INSTALL in ci.splitlines()[-1], ci
    assert INSTALL in guide
    assert (ROOT / ".ci" / "refresh-constraints").stat().st_mode & 0o111


def test_dev_holds_every_extra():
    """.ci/refresh-constraints resolves the `dev` extra: an extra left out of it gets no pins."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = {
        name
        for line in project["optional-dependencies"]["dev"]
        if canonicalize_name(Requirement(line).name) == DIST
        for name in Requirement(line).extras
    }
    missing = set(project["optional-dependencies"]) - {"dev"} - dev
    assert not missing, (
        f"add {sorted(f'{DIST}[{m}]' for m in missing)} to the `dev` extra, then run "
        ".ci/refresh-constraints"
    )


@pytest.mark.parametrize("name, env", list(environments()), ids=[n for n, _ in environments()])
def test_constraints_pin_every_requirement_of_every_extra(name, env):
    """One pin per package per environment, inside every range pyproject.toml gives it: so a change
    of a range in pyproject.toml without a refresh fails here, offline and at once."""
    table = pins()
    problems = []
    for extra, req in project_requirements():
        if req.marker is not None and not req.marker.evaluate(dict(env, extra=extra)):
            continue
        chosen = pin_for(canonicalize_name(req.name), env, table)
        if len(chosen) != 1:
            problems.append(f"[{extra or 'base'}] {req}: {len(chosen)} pins apply ({chosen})")
        elif not req.specifier.contains(chosen[0], prereleases=True):
            problems.append(f"[{extra or 'base'}] {req}: pinned {chosen[0]}, outside the range")
    assert not problems, "constraints.txt is stale; run .ci/refresh-constraints:\n" + "\n".join(
        problems
    )


def test_the_pins_respect_the_torch_cap_of_our_machines():
    table = pins()
    for name, cap in (("torch", Version("2.14.1")), ("torchvision", Version("0.29.1"))):
        assert table[name], name
        assert all(version <= cap for version, _ in table[name]), (name, table[name])


def test_no_pin_applies_twice_anywhere():
    table = pins()
    for label, env in environments():
        for name in table:
            assert len(pin_for(name, env, table)) <= 1, (label, name, table[name])


@pytest.mark.slow
def test_dev_extras_resolve_at_once_from_an_empty_cache(tmp_path):
    """The README's command, resolved from scratch (installed packages ignored, no cache) as a
    newcomer's pip does: it finishes well inside the time limit, without backtracking, and every
    package it chooses is pinned by constraints.txt at that version (so no range is left for pip to
    walk). Without constraints.txt, pip 23.2 on today's extras had not resolved after 15 minutes."""
    limit = 300
    report = tmp_path / "report.json"
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-cache-dir",
            "--report",
            str(report),
            "-e",
            ".[dev]",
            "-c",
            "constraints.txt",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=limit,
    )
    took = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pip is looking at multiple versions" not in result.stdout + result.stderr, (
        result.stdout[-3000:]
    )
    env = {k: v for k, v in json.loads(report.read_text())["environment"].items()}
    table = pins()
    unpinned, moved = [], []
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        if name == DIST:
            continue
        chosen = pin_for(name, dict(env, extra=""), table)
        if not chosen:
            unpinned.append(f"{name}=={meta['version']}")
        elif Version(meta["version"]) != chosen[0]:
            moved.append(f"{name}: {meta['version']} resolved, {chosen[0]} pinned")
    assert not unpinned and not moved, (
        f"run .ci/refresh-constraints: unpinned {unpinned}, moved {moved}"
    )
    print(f"resolved the dev extras in {took:.0f} s")
