"""A cache build split over 4 ranks of a real gloo group (issue #38, `build_ranks.py`,
`FolderBuild`), the ranks forked in milliseconds from the zygote, each in the working directory
of its "node" with the cache at a relative path: on 2 node-local folders each ends with the whole
cache (the parts decoded on the other node received), on one shared folder one cache is built,
a folder that lacks the cache while another holds one gets a copy (nothing built again), and a
build that not every rank calls fails naming how many came. The builders that use it run on two
simulated torchrun nodes in `tests/test_nodes.py` (slow tier)."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import torch.distributed as dist
import recipes.common.caches.build_ranks as build_ranks
from recipes.common.caches.cache_builds import FolderBuild

rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=world)
N, target = 1000, Path("cache/numbers")


class Missing(Exception):
    pass


def open_cache():
    try:
        header = json.loads((target / "header.json").read_text())
        data = (target / "data.bin").read_bytes()
    except (OSError, ValueError) as why:
        raise Missing(why) from None
    if header.get("count") != N or data != np.arange(N, dtype="<i4").tobytes():
        raise Missing("incomplete")


if mode == "late":
    build_ranks.RENDEZVOUS_S, build_ranks.NOTICE_S = 1.5, 0.5
    if rank == world - 1:
        time.sleep(2.5)
        sys.exit(0)
# a node's own data, or everyone's
inputs = Path.cwd().name if mode == "differ" else "the same data"
build = FolderBuild(target, inputs=inputs)
if build.needed(open_cache, Missing):
    with build:
        Path(f"built.{rank}").write_text("1")
        with open(build.part("data.bin"), "wb") as f:
            f.write(np.arange(N, dtype="<i4")[build.block(N).start:build.block(N).stop].tobytes())
        build.concat("data.bin")
        build.publish({"format": "numbers", "count": N})
open_cache()  # every rank reads its folder's copy
report = {"leader": build.leader, "groups": build.ranks.groups}
Path(f"report.{rank}.json").write_text(json.dumps(report))
dist.barrier()
dist.destroy_process_group()
"""


def _launch(zygote, folders, mode="ok", timeout=60):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    children = [
        zygote.python(CHILD, rank, len(folders), mode, cwd=folder, env=env)
        for rank, folder in enumerate(folders)
    ]
    for child in children:
        child.wait(timeout=timeout)
    return children


def _cache(folder):
    return (folder / "cache" / "numbers" / "data.bin").read_bytes()


def _leftovers(folder):
    return sorted(p.name for p in (folder / "cache").iterdir() if p.name.startswith("."))


def test_two_node_local_folders_each_end_with_the_whole_cache_then_a_lost_disk_gets_a_copy(
    zygote, tmp_path
):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    children = _launch(zygote, [nodes[0], nodes[0], nodes[1], nodes[1]])
    assert all(c.returncode == 0 for c in children), [c.stderr for c in children]
    whole = np.arange(1000, dtype="<i4").tobytes()
    for node in nodes:
        assert _cache(node) == whole and not _leftovers(node)  # no temp, no marker left
    reports = [json.loads((nodes[r // 2] / f"report.{r}.json").read_text()) for r in range(4)]
    assert reports[0]["groups"] == [[0, 1], [2, 3]] and [r["leader"] for r in reports] == [
        True,
        False,
        True,
        False,
    ]
    assert sorted(p.name for n in nodes for p in n.glob("built.*")) == [
        "built.0",
        "built.1",
        "built.2",
        "built.3",
    ]
    # node 1 comes back with an empty disk: it receives node 0's copy, nothing is built again
    import shutil

    shutil.rmtree(nodes[1])
    nodes[1].mkdir()
    for marker in nodes[0].glob("built.*"):
        marker.unlink()
    children = _launch(zygote, [nodes[0], nodes[0], nodes[1], nodes[1]])
    assert all(c.returncode == 0 for c in children), [c.stderr for c in children]
    assert _cache(nodes[1]) == whole and not _leftovers(nodes[1])
    assert not list(nodes[0].glob("built.*")) and not list(nodes[1].glob("built.*"))


def test_one_shared_folder_builds_one_cache(zygote, tmp_path):
    children = _launch(zygote, [tmp_path] * 4)
    assert all(c.returncode == 0 for c in children), [c.stderr for c in children]
    assert _cache(tmp_path) == np.arange(1000, dtype="<i4").tobytes() and not _leftovers(tmp_path)
    report = json.loads((tmp_path / "report.3.json").read_text())
    assert report["groups"] == [[0, 1, 2, 3]] and not report["leader"]


@pytest.mark.slow  # waits out the rendezvous (3 s)
def test_a_build_not_every_rank_calls_fails_naming_how_many_came(zygote, tmp_path):
    layout = [tmp_path / "a", tmp_path / "a", tmp_path / "b"]
    for folder in layout:
        folder.mkdir(exist_ok=True)
    children = _launch(zygote, layout, mode="late")
    failed = [c for c in children[:-1] if c.returncode != 0]
    assert failed and all(
        "BuildRendezvousError" in c.stderr
        and "only 2 of the 3 ranks" in c.stderr
        and "distributed=False" in c.stderr
        for c in failed
    )
    assert (
        "2 of the 3 ranks have called the build after 0 s; waiting up to 2 s" in children[0].stderr
    )


def test_ranks_given_other_inputs_fail_naming_them_before_any_work(zygote, tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    children = _launch(zygote, [nodes[0], nodes[0], nodes[1], nodes[1]], mode="differ")
    assert all(c.returncode != 0 for c in children)
    assert all(
        "BuildInputsError" in c.stderr
        and "ranks [0, 1]" in c.stderr
        and "ranks [2, 3]" in c.stderr
        and "cp -p or rsync -a" in c.stderr
        for c in children
    )
    assert not list(tmp_path.rglob("built.*")) and not list(
        tmp_path.rglob("data.bin*")
    )  # nothing decoded
