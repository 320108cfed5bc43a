"""build_image_cache under torchrun (2 gloo processes): a rank that dies mid-build leaves nothing
published. The byte-identical distributed build is checked with the other domains' builds, in one
launch, by tests/test_cache_builds_distributed.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from recipes.testing import make_image_folder
from recipes.vision import ImageFolderFast

SCRIPT = Path(__file__).with_name("dist_image_cache_script.py")


def _torchrun(*args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=180)


@pytest.mark.slow  # the FolderBuild protocol it shares is killed mid-build in the fast tier (audio)
def test_a_rank_that_dies_mid_build_leaves_nothing_published(tmp_path):
    root = make_image_folder(tmp_path / "tree", classes=2, per_class=6, size=(160, 120), seed=9)
    out = _torchrun(root, tmp_path / "cache", "die")
    assert out.returncode != 0
    assert not list((tmp_path / "cache").glob("images-*"))  # no partial cache served later
    ds = ImageFolderFast(root, size=64, cache_dir=tmp_path / "cache")  # opening sweeps the dead temp folder
    assert ds.cache is None and not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]
