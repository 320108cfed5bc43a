"""The house's layout, tested (issue #29): each room's `__init__.py` says what it may import,
and no module imports outside that; no import circle anywhere in the library; no folder over 12
modules; `common/` has no loose module beyond the shared ones (sizes: `tests/test_form.py`).

Imports are read from the source (`ast`), at any depth: a lazy import inside a function and an
`if TYPE_CHECKING:` import count, since both are edges a reader follows.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("common", "vision", "nlp", "audio")
SOURCES = sorted(
    p
    for folder in (*DOMAINS, "recipes")
    for p in (ROOT / folder).rglob("*.py")
    if "__pycache__" not in p.parts
)
SHARED_IN_COMMON = {
    "__init__.py",
    "loader_warning.py",
}  # the face, and the one warning class every room raises


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in DOMAINS:
        parts = ["recipes", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_of(p): p for p in SOURCES}


def imports(path: Path) -> set[str]:
    """The library modules `path` imports (a package's module named in `from package import
    module` counts as that module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "recipes")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "recipes"
        ):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m in MODULES} - {module_of(path)}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def rooms() -> dict[str, set[str]]:
    """Each room (a subpackage of a domain) and the packages or modules its docstring says it
    may import, besides itself; a short name means a sibling in the same domain."""
    found = {}
    for init in sorted(ROOT.glob("*/*/__init__.py")):
        if init.parts[-3] not in DOMAINS:
            continue
        room = module_of(init)
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        match = re.search(r"May import:(.*?)(?:\n\s*\n|\Z)", doc, re.S)
        assert match, f"{init.relative_to(ROOT)}: its docstring needs a `May import:` paragraph"
        domain = room.rsplit(".", 1)[0]
        allowed = set()
        for name in re.findall(r"`([\w.]+)`", match.group(1)):
            allowed.add(name if name.startswith("recipes") else f"{domain}.{name}")
        found[room] = allowed
    return found


ROOMS = rooms()


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_imports_only_what_its_docstring_allows(room):
    allowed = ROOMS[room]
    wrong = []
    for module, deps in GRAPH.items():
        if not within(module, room):
            continue
        for dep in deps:
            if within(dep, room) or any(within(dep, a) for a in allowed):
                continue
            wrong.append(f"{module} imports {dep}")
    assert not wrong, f"{room} may import {sorted(allowed)} only:\n" + "\n".join(sorted(wrong))


def test_common_imports_no_domain_and_domains_import_no_other_domain():
    wrong = []
    for module, deps in GRAPH.items():
        domain = module.split(".")[1] if module.count(".") else None
        for dep in deps:
            other = dep.split(".")[1] if dep.count(".") else None
            if domain == "common" and other in ("vision", "nlp", "audio"):
                wrong.append(f"{module} imports {dep}")
            if (
                domain in ("vision", "nlp", "audio")
                and other in DOMAINS
                and other not in ("common", domain)
            ):
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_anywhere():
    # a package's __init__ re-exports its rooms (the public face): the edges into it are not
    # circles of design, so modules that import a face are read as importing what it names
    graph = {m: set(deps) for m, deps in GRAPH.items() if not MODULES[m].name == "__init__.py"}
    for m, deps in graph.items():
        faces = {d for d in deps if MODULES[d].name == "__init__.py"}
        graph[m] = (deps - faces) | {x for f in faces for x in GRAPH[f] if x in graph}
    assert not cycles(graph), cycles(graph)


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_folder_holds_more_than_12_modules():
    folders = {}
    for path in SOURCES:
        if path.name != "__init__.py":
            folders.setdefault(path.parent, []).append(path.name)
    crowded = {str(f.relative_to(ROOT)): len(n) for f, n in folders.items() if len(n) > 12}
    assert not crowded, crowded


def test_common_has_no_loose_module_beyond_the_shared_ones():
    loose = sorted(p.name for p in (ROOT / "common").glob("*.py"))
    assert set(loose) <= SHARED_IN_COMMON, loose
