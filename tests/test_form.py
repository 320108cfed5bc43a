"""The house's form, measured (issue 47; docs/contributing.md): what a reader reads of each
library file, and how plainly it is written.

- Size: at most 400 formatted lines below the module docstring (the header and its Copy-with
  list do not count, so nobody trims documentation to make room); at most 3 files within 10
  lines of that limit; no function over 100 lines, its docstring aside.
- Density, over the library (common, vision, nlp, audio, recipes), per 1,000 lines: at most 50
  characters per non-blank code line (docstrings and comments aside), 2 tuple-packing
  assignments (`a, b = x, y`), 10 conditional expressions, and 1.5 imports of `recipes.*`
  inside functions.
- Records: no private record read by position (`self._resume[3]`).

The same measures, printed for any tree: `python tests/test_form.py [ROOT]`.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("common", "vision", "nlp", "audio", "recipes")
MAX_LINES = 400
NEAR_LIMIT = 10
MAX_NEAR_LIMIT = 3
MAX_FUNCTION = 100


def sources(root: Path) -> list[Path]:
    return sorted(
        p for d in LIBRARY for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts
    )


def is_docstring(node: ast.stmt | None) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def lines_below_docstring(text: str, tree: ast.Module) -> int:
    first = tree.body[0] if tree.body else None
    header = span(first) if is_docstring(first) else 0
    return len(text.splitlines()) - header


def function_lengths(tree: ast.Module) -> dict[str, int]:
    """Each function's lines, its docstring aside (nested functions count in their parent too)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = span(node.body[0]) if is_docstring(node.body[0]) else 0
            found[f"{node.name}:{node.lineno}"] = span(node) - doc
    return found


@dataclass
class Density:
    """The counts behind the density measures of a set of files."""

    lines: int = 0
    code_lines: int = 0
    code_characters: int = 0
    tuple_packing: int = 0
    conditional_expressions: int = 0
    imports_inside_functions: int = 0

    def per_1k(self, count: int) -> float:
        return 1000 * count / self.lines

    @property
    def characters_per_code_line(self) -> float:
        return self.code_characters / self.code_lines


def is_own_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "recipes"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "recipes" for alias in node.names)
    return False


def count(path: Path, density: Density) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    density.lines += len(text.splitlines())
    skipped = set()
    inside_functions = set()
    for node in ast.walk(tree):
        if is_docstring(node):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                density.tuple_packing += 1
        if isinstance(node, ast.IfExp):
            density.conditional_expressions += 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if is_own_import(inner):
                    inside_functions.add(id(inner))
    density.imports_inside_functions += len(inside_functions)
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    for number, line in enumerate(text.splitlines(), start=1):
        if number in skipped:
            continue
        code = line[: comments[number]] if number in comments else line
        if code.strip():
            density.code_lines += 1
            density.code_characters += len(code.rstrip())


def measure(root: Path) -> Density:
    density = Density()
    for path in sources(root):
        count(path, density)
    return density


def private_records_by_position(tree: ast.Module) -> list[int]:
    """Lines reading `self._x[3]`: a private record indexed by a constant position."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Subscript):
            continue
        value, index = node.value, node.slice
        if (
            isinstance(value, ast.Attribute)
            and value.attr.startswith("_")
            and isinstance(index, ast.Constant)
            and type(index.value) is int
        ):
            found.append(node.lineno)
    return found


def test_no_library_file_is_over_400_lines_below_its_docstring():
    sizes = {}
    for path in sources(ROOT):
        text = path.read_text()
        sizes[str(path.relative_to(ROOT))] = lines_below_docstring(text, ast.parse(text))
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    near = {name: n for name, n in sizes.items() if MAX_LINES - NEAR_LIMIT <= n <= MAX_LINES}
    assert not over, f"split these by responsibility (docs/contributing.md): {over}"
    assert len(near) <= MAX_NEAR_LIMIT, f"more than {MAX_NEAR_LIMIT} files near the limit: {near}"


def test_no_library_function_is_over_100_lines():
    long = {}
    for path in sources(ROOT):
        for name, n in function_lengths(ast.parse(path.read_text())).items():
            if n > MAX_FUNCTION:
                long[f"{path.relative_to(ROOT)}:{name}"] = n
    assert not long, long


def test_the_library_reads_plainly():
    density = measure(ROOT)
    assert density.characters_per_code_line <= 50, density
    assert density.per_1k(density.tuple_packing) <= 2, density
    assert density.per_1k(density.conditional_expressions) <= 10, density
    assert density.per_1k(density.imports_inside_functions) <= 1.5, density


def test_no_private_record_is_read_by_position():
    found = {}
    for path in sources(ROOT):
        lines = private_records_by_position(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"name the fields (a NamedTuple or a frozen dataclass): {found}"


def test_the_measures_see_what_they_count(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "m.py").write_text(
        '"""Doc."""\n'
        "def f(x):\n"
        "    from recipes.common import y  # a comment\n"
        "    a, b = x, y\n"
        "    return a if b else self._rest[3]\n"
    )
    density = measure(tmp_path)
    assert (density.lines, density.code_lines) == (5, 4)
    assert density.tuple_packing == density.conditional_expressions == 1
    assert density.imports_inside_functions == 1
    tree = ast.parse((tmp_path / "common" / "m.py").read_text())
    assert private_records_by_position(tree) == [5]
    assert function_lengths(tree) == {"f:2": 4}
    assert lines_below_docstring((tmp_path / "common" / "m.py").read_text(), tree) == 4


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    d = measure(root)
    print(f"{d.lines:,} lines, {d.code_lines:,} code lines")
    print(f"characters per code line     {d.characters_per_code_line:.1f}  (at most 50)")
    print(f"tuple packing per 1k         {d.per_1k(d.tuple_packing):.2f}  (at most 2)")
    print(f"conditional expr. per 1k     {d.per_1k(d.conditional_expressions):.2f}  (at most 10)")
    print(f"imports inside functions/1k  {d.per_1k(d.imports_inside_functions):.2f}  (at most 1.5)")
    for path in sources(root):
        text = path.read_text()
        tree = ast.parse(text)
        n = lines_below_docstring(text, tree)
        long = {k: v for k, v in function_lengths(tree).items() if v > MAX_FUNCTION}
        if n > MAX_LINES - NEAR_LIMIT or long:
            print(f"  {path.relative_to(root)}: {n} lines below its docstring {long or ''}")
