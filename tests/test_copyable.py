"""Recipe files copy on their own. Each library file names, in its header, the other project
files it needs (`Copy with: common/caches/cache_files.py, vision/decoding/decode.py.`). This test
reads that line and checks it two ways: statically, every `recipes.*` import the file and its copy
set make (outside `try: ... except ImportError:` and `if TYPE_CHECKING:`) must land inside the
declared set, and the set must be exactly what the imports reach; and by running it: exactly those
files are copied into an empty folder, their imports rewritten to plain module imports, and imported
(the recipes, also exercised; every file, in the fast tier) in a process where the `recipes` package
cannot be imported at all. What a user must read to adapt a recipe is its lines, not its file count.

The copies run in children forked from one process that imported the third-party libraries
(torch, numpy, OpenCV, transformers, soundfile) and nothing of `recipes`: each copy starts in a
fresh fork, in its own folder, without paying the imports again.
"""

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("common", "vision", "nlp", "audio")
LIBRARY = sorted(
    str(p.relative_to(ROOT))
    for d in DOMAINS
    for p in (ROOT / d).rglob("*.py")
    if p.name != "__init__.py"
)
# Training templates run against the installed package (`recipes template vision > train.py`).
PACKAGE = "the installed recipes package"

# recipe file -> a smoke run of its copy (every other library file is imported in its copy)
SMOKE = {
    "common/sampling/bucketing.py": """
        from bucketing import LengthBucketSampler
        sampler = LengthBucketSampler([5, 9, 3, 12, 7, 7, 2, 30], max_tokens=32, seed=0)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(8))
        assert sampler.state_dict(batches_done=1)["global_batches_done"] == 1
    """,
    "common/remote/prefetch_cache.py": """
        from pathlib import Path
        from prefetch_cache import PrefetchCache
        src = Path("remote.bin"); src.write_bytes(b"x" * 1000)
        cache = PrefetchCache("cache", max_bytes=10_000)
        assert cache.get(str(src.resolve())).read_bytes() == b"x" * 1000
        assert cache.stats()["misses"] == 1
    """,
    "common/shards/sharded_dataset.py": """
        from pathlib import Path
        from sharded_dataset import ShardedIterableDataset
        paths = []
        for s in range(3):
            Path(f"s{s}.txt").write_text(" ".join(str(10 * s + i) for i in range(4)))
            paths.append(f"s{s}.txt")
        def read(p):
            return [int(x) for x in Path(p).read_text().split()]
        ds = ShardedIterableDataset(paths, read, rank=0, world_size=1)
        assert sorted(ds) == sorted(10 * s + i for s in range(3) for i in range(4))
    """,
    "audio/chunked.py": """
        import numpy as np, soundfile as sf
        from chunked import ChunkedAudioDataset
        sf.write("a.wav", np.zeros(16000, np.float32), 16000)
        ds = ChunkedAudioDataset(["a.wav"], chunk_seconds=0.25)
        assert len(ds) == 4 and ds[3][0].shape == (1, 4000)
    """,
    "audio/spectrogram_cache.py": """
        import numpy as np, soundfile as sf
        from chunked import ChunkedAudioDataset
        from spectrogram_cache import build_spectrogram_cache
        sf.write("a.wav", np.random.default_rng(0).normal(0, 0.1, 16000).astype(np.float32), 16000)
        ds = ChunkedAudioDataset(["a.wav"], chunk_seconds=0.25)
        cache = build_spectrogram_cache(ds, "features", n_mels=40, num_workers=None, progress=False)
        assert len(cache) == 4 and cache[0][0].shape == (40, 26)
        again = build_spectrogram_cache(ds, "features", n_mels=40, num_workers=0, progress=False)
        assert again.path == cache.path
    """,
    "nlp/token_cache.py": """
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
        from token_cache import build_token_cache
        texts = ["the cat sat", "on the mat", "a dog ran far away", "the end"] * 5
        raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        raw.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
        cache = build_token_cache(texts, tokenizer, "tokens", batch_size=3, progress=False)
        got = [cache[i]["input_ids"].tolist() for i in range(len(texts))]
        assert got == tokenizer(texts)["input_ids"]
    """,
    "vision/image_folder.py": """
        import os, cv2, numpy as np, torch
        from image_folder import ImageFolderFast
        from image_cache_build import build_image_cache
        ramp = np.tile(np.linspace(0, 200, 80), (60, 1))
        for c in range(2):
            os.makedirs(f"tree/c{c}")
            for i in range(3):
                pixels = np.dstack([ramp, ramp * 0 + 10 * i, ramp[::-1]]).astype(np.uint8)
                cv2.imwrite(f"tree/c{c}/{i}.jpg", pixels)
        ds = ImageFolderFast("tree", size=32)
        image, target = ds[4]
        assert image.shape == (3, 32, 32) and target == 1
        build_image_cache(ds, "cache", num_workers=None, progress=False)
        again = ImageFolderFast("tree", size=32, cache_dir="cache")
        assert again.cache is not None
        assert (again[4][0].int() - image.int()).abs().float().mean() < 3
    """,
}


def _template(name: str) -> bool:
    """A training template: `<domain>/template.py`, or `template_<framework>.py` (issue 31)."""
    return re.fullmatch(r"\w+/template(_\w+)?\.py", name) is not None


def declared(name: str) -> list[str] | None:
    """The files `name`'s header says to copy with it: a list, [] for "nothing", None when the
    header says PACKAGE or has no `Copy with:` line (the caller tells those apart)."""
    doc = ast.get_docstring(ast.parse((ROOT / name).read_text()), clean=False) or ""
    found = []
    for line in doc.splitlines():
        if line.startswith("Copy with:"):
            found.append(line[len("Copy with:") :])
        elif found and line.startswith("  ") and not found[-1].rstrip().endswith("."):
            found[-1] += " " + line.strip()  # a wrapped list goes on, indented, until its full stop
        elif re.fullmatch(r"\s*((common|vision|nlp|audio)/(\w+/)*\w+\.py[,.]?\s*)+", line):
            raise AssertionError(
                f"{name}: a list of files outside its `Copy with:` line: {line.strip()!r}"
            )
    if len(found) != 1:
        raise AssertionError(
            f"{name}: its header docstring needs exactly one `Copy with: ...` line, "
            f"found {len(found)}"
        )
    text = found[0].strip().removesuffix(".")
    if text == "nothing":
        return []
    if text == PACKAGE:
        return None
    return [part.strip() for part in text.split(",")]


def _module_file(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "recipes":
        raise ValueError(module)
    if len(parts) == 1:
        return "recipes/__init__.py"
    if parts[1] in DOMAINS:
        rest = parts[2:]
        base = Path(parts[1])
    else:
        rest = parts[1:]
        base = Path("recipes")
    if not rest:
        return str(base / "__init__.py")
    candidate = base.joinpath(*rest)
    return (
        str(candidate / "__init__.py")
        if (ROOT / candidate).is_dir()
        else str(candidate.with_suffix(".py"))
    )


def hard_imports(name: str) -> set[str]:
    """The project files `name` imports unconditionally (at any depth: lazy imports count)."""
    tree = ast.parse((ROOT / name).read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        # an import with a fallback: `try: ... except ImportError: <not a bare re-raise>`
        optional = isinstance(node, ast.Try) and any(
            handler.type is not None
            and {getattr(n, "id", None) for n in ast.walk(handler.type)}
            & {"ImportError", "ModuleNotFoundError"}
            and not (len(handler.body) == 1 and isinstance(handler.body[0], ast.Raise))
            for handler in node.handlers
        )
        # exactly `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), never its negation
        type_only = isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        )
        if optional or type_only:
            guarded.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(
                f"{name}:{node.lineno}: a relative import (`{ast.unparse(node)}`) breaks a copied "
                "file; import `recipes.<domain>.<module>` instead"
            )
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "importlib.import_module",
            "import_module",
            "__import__",
        ):
            argument = node.args[0] if node.args else None
            if (
                isinstance(argument, ast.Constant)
                and str(argument.value).split(".")[0] == "recipes"
            ):
                found.add(_module_file(argument.value))
            elif not isinstance(argument, ast.Constant):
                raise AssertionError(
                    f"{name}:{node.lineno}: `{ast.unparse(node)}` imports a module named at run "
                    "time, which no copy set can declare"
                )
            continue
        if isinstance(node, ast.Import):
            found.update(
                _module_file(a.name) for a in node.names if a.name.split(".")[0] == "recipes"
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "recipes"
        ):
            target = _module_file(node.module)
            if target.endswith("__init__.py"):  # `from recipes.common import loader` names a module
                folder = Path(target).parent
                subs = [
                    str(folder / f"{a.name}.py")
                    for a in node.names
                    if (ROOT / folder / f"{a.name}.py").exists()
                ]
                found.update(subs if len(subs) == len(node.names) else [target])
            else:
                found.add(target)
    return found - {name}


def reach(name: str) -> set[str]:
    """Every project file `name` needs, transitively (itself excluded)."""
    seen, todo = set(), [name]
    while todo:
        for dep in hard_imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen - {name}


@pytest.mark.parametrize("name", LIBRARY)
def test_a_library_file_declares_exactly_the_files_its_imports_reach(name):
    files = declared(name)
    if files is None:
        assert _template(name), f"{name}: only training templates may say `Copy with: {PACKAGE}.`"
        return
    needs = reach(name)
    packages = sorted(f for f in needs if f.endswith("__init__.py"))
    assert not packages, (
        f"{name} imports a package ({packages}): import from the module that defines the "
        "name, so a copy needs only the files its header names"
    )
    outside = sorted(needs - set(files))
    assert not outside, (
        f"{name}: its imports reach {outside}, which its `Copy with:` line does not name"
    )
    unused = sorted(set(files) - needs)
    assert not unused, f"{name}: `Copy with:` names {unused}, which nothing it imports needs"
    assert all((ROOT / f).is_file() for f in files), files


def _rewrite(text: str) -> str:
    """`from recipes.common.sampling.sharding import x` -> `from sharding import x`, and alike."""
    text = re.sub(
        r"from recipes\.\w+ import (\w+)( as \w+)?\n", r"import \1\2\n", text
    )  # a module of a package
    text = re.sub(r"from recipes\.(?:\w+\.)+(\w+) import", r"from \1 import", text)
    return re.sub(r"import recipes\.(?:\w+\.)*(\w+) as", r"import \1 as", text)


# Reads a folder per line; runs its use_it.py in a forked child with that folder as its working
# directory and first import path; answers the child's exit status and the tail of its stderr.
ZYGOTE = """
import json, os, sys, traceback
import cv2, numpy, soundfile, torch, transformers  # noqa: F401 (paid once, inherited by every fork)
imported = [m for m in sys.modules if m == "recipes" or m.startswith("recipes.")]
assert not imported, "the zygote imported recipes"
sys.modules["recipes"] = None  # the package is out of reach: only the copies
for line in sys.stdin:
    folder = line.strip()
    err = os.path.join(folder, "stderr.txt")
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        status = 0
        try:
            os.chdir(folder)
            sys.path.insert(0, folder)
            code = open("use_it.py").read()
            exec(compile(code, os.path.join(folder, "use_it.py"), "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    reply = {"status": os.waitstatus_to_exitcode(status), "stderr": open(err).read()[-3000:]}
    print(json.dumps(reply), flush=True)
"""


@pytest.fixture(scope="module")
def run_copy():
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )

    def run(name: str, script: str, folder: Path) -> None:
        files = declared(name)
        assert files is not None
        for file in [name, *files]:
            (folder / Path(file).name).write_text(_rewrite((ROOT / file).read_text()))
        (folder / "use_it.py").write_text(textwrap.dedent(script))
        zygote.stdin.write(f"{folder}\n")
        zygote.stdin.flush()
        answer = zygote.stdout.readline()
        assert answer, f"the copy runner ended (exit status {zygote.wait()})"
        done = json.loads(answer)
        assert done["status"] == 0, done["stderr"]

    yield run
    zygote.stdin.close()
    zygote.wait(timeout=30)


@pytest.mark.parametrize("recipe", sorted(SMOKE))
def test_a_recipe_copied_with_its_declared_files_runs_without_the_package(
    recipe, tmp_path, run_copy
):
    run_copy(recipe, SMOKE[recipe], tmp_path)


@pytest.mark.parametrize("name", [n for n in LIBRARY if n not in SMOKE and not _template(n)])
def test_every_library_file_copied_with_its_declared_files_imports(name, tmp_path, run_copy):
    run_copy(name, f"import {Path(name).stem}\n", tmp_path)


def test_a_copy_that_reaches_for_the_package_fails(tmp_path, run_copy):
    """The runner itself: a copy importing `recipes` must fail, so a passing copy means
    something."""
    with pytest.raises(AssertionError, match="recipes"):
        run_copy(
            "common/sampling/sharding.py", "import sharding\nimport recipes.common\n", tmp_path
        )


def copy_table() -> str:
    """The docs' copy table (docs/copy-and-adapt.md), from the headers: each smoke-tested
    recipe, its declared copy set, and the lines of all of them. `python tests/test_copyable.py`
    prints it."""
    rows = ["| recipe file | copy with | lines in all |", "|---|---|---:|"]
    for recipe in sorted(SMOKE):
        files = sorted(declared(recipe) or [])
        lines = sum(len((ROOT / f).read_text().splitlines()) for f in [recipe, *files])
        rows.append(f"| `{recipe}` | {', '.join(f'`{f}`' for f in files)} | {lines:,} |")
    return "\n".join(rows)


def test_the_docs_copy_table_is_the_one_the_headers_give():
    """Its files, row for row (the line counts are informative: they move with every edit)."""

    def files_only(table: str) -> list[str]:
        return [row.rsplit("|", 2)[0] for row in table.splitlines() if row.startswith("| `")]

    page = (ROOT / "docs" / "copy-and-adapt.md").read_text()
    start = page.index("| recipe file | copy with | lines in all |")
    in_page = page[start : page.index("\n\n", start)]
    assert files_only(in_page) == files_only(copy_table()), (
        "the copy table of docs/copy-and-adapt.md differs from the headers: replace it with the "
        "output of `python tests/test_copyable.py`"
    )


if __name__ == "__main__":
    print(copy_table())
