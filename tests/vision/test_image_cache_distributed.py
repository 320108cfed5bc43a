"""build_image_cache under torchrun (2 gloo processes): the ranks split the decoding, rank 0
publishes a folder byte-identical to a single-process build, and a rank that dies mid-build leaves
nothing published."""

import subprocess
import sys
from pathlib import Path

from recipes.testing import make_image_folder
from recipes.vision import ImageFolderFast, build_image_cache

SCRIPT = Path(__file__).with_name("dist_image_cache_script.py")


def _torchrun(*args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=180)


def test_a_distributed_build_equals_a_single_process_build(tmp_path):
    root = make_image_folder(tmp_path / "tree", classes=3, per_class=5, size=(160, 120), seed=8)
    out = _torchrun(root, tmp_path / "split", "ok")
    assert out.returncode == 0, out.stderr[-3000:]
    single = build_image_cache(ImageFolderFast(root, size=64), tmp_path / "single", num_workers=0, progress=False)
    assert [p.name for p in (tmp_path / "split").iterdir()] == [single.path.name]  # no temp left
    split = tmp_path / "split" / single.path.name
    files = sorted(p.name for p in single.path.iterdir())
    assert files == sorted(p.name for p in split.iterdir())
    assert all((split / f).read_bytes() == (single.path / f).read_bytes() for f in files)


def test_a_rank_that_dies_mid_build_leaves_nothing_published(tmp_path):
    root = make_image_folder(tmp_path / "tree", classes=2, per_class=6, size=(160, 120), seed=9)
    out = _torchrun(root, tmp_path / "cache", "die")
    assert out.returncode != 0
    assert not list((tmp_path / "cache").glob("images-*"))  # no partial cache served later
    ds = ImageFolderFast(root, size=64, cache_dir=tmp_path / "cache")  # opening sweeps the dead temp folder
    assert ds.cache is None and not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]
