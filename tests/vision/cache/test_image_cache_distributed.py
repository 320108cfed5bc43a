"""build_image_cache under torchrun (2 gloo processes): a rank that dies mid-build leaves nothing
published. The byte-identical distributed build is checked with the other domains' builds, in one
launch, by tests/test_cache_builds_distributed.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.testing import make_image_folder
from recipes.vision import ImageFolderFast

SCRIPT = Path(__file__).with_name("dist_image_cache_script.py")


def _torchrun(*args):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SCRIPT),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow  # the FolderBuild protocol it shares is killed mid-build in the fast tier (audio)
def test_a_rank_that_dies_mid_build_leaves_nothing_published(tmp_path):
    root = make_image_folder(tmp_path / "tree", classes=2, per_class=6, size=(160, 120), seed=9)
    out = _torchrun(root, tmp_path / "cache", "die")
    assert out.returncode != 0
    assert not list((tmp_path / "cache").glob("images-*"))  # no partial cache served later
    ds = ImageFolderFast(
        root, size=64, cache_dir=tmp_path / "cache"
    )  # opening sweeps the dead temp folder
    assert ds.cache is None and not [
        p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")
    ]


NODE = r"""
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from recipes.vision import ImageFolderFast, build_image_cache
from recipes.vision.image_folder import ImageFolderFast as Counted

rank, world = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=world)
reads, read = [0], Counted._read
Counted._read = lambda self, i: (reads.__setitem__(0, reads[0] + 1), read(self, i))[1]
ds = ImageFolderFast("data", size=64, train=False)
build_image_cache(ds, "cache", num_workers=0, progress=False)
Path(f"reads.{rank}").write_text(str(reads[0]))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow  # four launches of two processes importing the vision domain (~10 s)
def test_two_node_local_folders_share_the_decodes_and_copy_a_missing_eval_view(zygote, tmp_path):
    """2 "nodes" (a rank each, its own folder): an eval set's cache and eval view decoded once by
    the job; a node that lost its eval view, or its whole cache, gets the other's copy (no
    decode; the copied header names its own data root); a node whose copy
    of the data has other modification times is refused, naming the ranks, before any decode."""
    import json
    import shutil
    import socket

    make_image_folder(tmp_path / "node0" / "data", classes=2, per_class=4, size=(160, 120), seed=3)
    shutil.copytree(
        tmp_path / "node0" / "data", tmp_path / "node1" / "data"
    )  # times kept, as cp -p

    def launch():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        children = [
            zygote.python(
                NODE,
                r,
                2,
                cwd=tmp_path / f"node{r}",
                env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            )
            for r in range(2)
        ]
        for child in children:
            child.wait(timeout=120)
        return children

    def reads():
        return sum(int((tmp_path / f"node{r}" / f"reads.{r}").read_text()) for r in range(2))

    assert all(c.returncode == 0 for c in launch())
    assert reads() == 2 * 8  # the cache and its eval view, each image once over both nodes
    views = [
        sorted(p.name for p in (tmp_path / f"node{r}" / "cache").glob("images-*/eval-*"))
        for r in range(2)
    ]
    assert views[0] == views[1] and len(views[0]) == 3
    headers = [
        json.loads(next((tmp_path / f"node{r}" / "cache").glob("images-*/header.json")).read_text())
        for r in range(2)
    ]
    assert headers[1]["root"] == str((tmp_path / "node1" / "data").resolve())
    for view in (tmp_path / "node1" / "cache").glob("images-*/eval-*"):
        view.unlink()
    assert all(c.returncode == 0 for c in launch()) and reads() == 0  # copied, not decoded
    assert (
        sorted(p.name for p in (tmp_path / "node1" / "cache").glob("images-*/eval-*")) == views[0]
    )
    shutil.rmtree(
        tmp_path / "node1" / "cache"
    )  # node 1 back with an empty disk: the whole cache copied
    assert all(c.returncode == 0 for c in launch()) and reads() == 0
    header = json.loads(
        next((tmp_path / "node1" / "cache").glob("images-*/header.json")).read_text()
    )
    assert header["root"] == str(
        (tmp_path / "node1" / "data").resolve()
    )  # its own, for its stale-cache sweep
    for image in (tmp_path / "node1" / "data").rglob("*.jpg"):
        os.utime(image, (1, 1))
    children = launch()
    assert all(
        c.returncode != 0 and "BuildInputsError" in c.stderr and "cp -p or rsync -a" in c.stderr
        for c in children
    )
