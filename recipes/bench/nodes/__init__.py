"""`recipes bench nodes`: a decoded-image cache built on 1 node and on 2 simulated nodes without a
shared disk, and the first batch after an elastic resume (a decoded cache, and shards).

Use when: sizing a job on several nodes with local disks: what a build costs each node (time,
decodes, disk), against every rank building alone (recipes 0.1's default under torchrun), and
how long a job resumed on another shape waits for its first batch.
Cost: the photographic set (`--images`, made once into the bench data folder) and its bytes
written as shards, then nine torchrun launches of `recipes/bench/nodes/job.py` on 127.0.0.1
(`recipes.testing_nodes`), each node in a temp folder of its own: a few minutes on 2 cores. Adapt
here: `--images`, `--ranks` (per node). Trade-off: the simulated nodes share this machine's cores,
so 2 nodes build in about the time 1 node does, not half of it: the decodes and the disk are what
carry over to a cluster, and the time shows what the exchange of parts costs beside them."""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import tempfile
import time
from pathlib import Path

from recipes.bench.images.data import ensure_data
from recipes.bench.nodes import job
from recipes.common import ShardedIterableDataset, write_shards
from recipes.testing_nodes import kill_node, report, start_nodes, wait_nodes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--images", type=int, default=240, help="photographs in the eval set (default 240)"
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node (default 2)")


def _launch(
    folders: list[Path], spec: dict, ranks: int, *, lose_node_after: int | None = None
) -> list[dict]:
    """One run; with `lose_node_after`, node 1 is killed once rank 0 checkpointed at that step."""

    shared = Path(spec["shared"]) / spec["run"]
    nodes = start_nodes(folders, Path(job.__file__), json.dumps(spec), per_node=ranks)
    try:
        _lose_a_node(nodes, shared, len(folders) * ranks, lose_node_after)
    except BaseException:
        for node in nodes:
            kill_node(node)
        raise
    wait_nodes(nodes, 600)
    if lose_node_after is None and any(n.returncode for n in nodes):
        raise RuntimeError("a run failed:\n" + report(nodes))
    return [json.loads(p.read_text()) for p in sorted(shared.glob("rank*.json"))]


def _lose_a_node(nodes, shared: Path, ranks: int, lose_node_after: int | None) -> None:
    """With `lose_node_after`: node 1 killed once every rank reported its checkpoint."""

    if lose_node_after is not None:
        deadline = time.monotonic() + 600
        while len(list(shared.glob("rank*.json"))) < ranks:
            if time.monotonic() > deadline or any(n.process.poll() is not None for n in nodes):
                raise RuntimeError(
                    "the run ended before its checkpoint:\n" + report(wait_nodes(nodes, 1))
                )
            time.sleep(0.5)
        kill_node(nodes[1])


def _work(folders: list[Path], what: str, run: str) -> int:
    return sum(
        len(p.read_text().split())
        for f in folders
        for p in (f / "counts").glob(f"{what}.build.{run}.*")
    )


def run(args: argparse.Namespace) -> int:
    per_rank = -(-args.images // (2 * args.ranks))  # images a rank reads in epoch 0 on 2 nodes
    stop = min(3, -(-per_rank // 8) - 1)  # a step of epoch 0 before its last batch
    if stop < 1:
        raise SystemExit(
            f"recipes bench nodes: --images {args.images} gives each of 2 x {args.ranks} ranks a "
            "single batch of 8; give at least two batches a rank (--images 32 or more per rank)."
        )
    root = ensure_data(args.images, kind="photos")
    base = {
        "kind": "images",
        "data": str(root.parent),
        "images": root.name,
        "epochs": 1,
        "batch": 8,
    }
    rows = []
    resumes = []
    with tempfile.TemporaryDirectory(prefix="recipes-bench-nodes-") as tmp:
        tmp = Path(tmp)
        for name, nodes, alone in (
            ("1 node", 1, False),
            ("2 nodes, every rank builds alone (0.1)", 2, True),
            ("2 nodes, node-local disks", 2, False),
        ):
            folders = [
                tmp / name.replace(" ", "_").replace(",", "") / f"node{k}" for k in range(nodes)
            ]
            run_name = f"build{len(rows)}"
            reports = _launch(
                folders,
                {**base, "shared": str(tmp / "shared"), "run": run_name, "alone": alone},
                args.ranks,
            )
            per_node = collections.defaultdict(int)
            for r in reports:
                per_node[r["node"]] = max(per_node[r["node"]], r["cache_bytes"])
            rows.append(
                (
                    name,
                    nodes * args.ranks,
                    max(r["build_s"] for r in reports),
                    _work(folders, "read", run_name),
                    max(per_node.values()),
                )
            )
        shards = _write_shards(root, tmp / "shards")
        for kind, extra in (
            ("images", {}),
            ("shards", {"kind": "shards", "url": str(shards), "storage_options": {}}),
        ):
            # an elastic resume: 2 nodes stopped after `stop` steps, node 1 lost, finished on 1 node
            # with 3 ranks
            folders = [tmp / f"elastic-{kind}" / f"node{k}" for k in range(2)]
            shared = tmp / f"elastic-{kind}" / "shared"
            spec = {**base, **extra, "shared": str(shared)}
            _launch(
                folders,
                {**spec, "run": "first", "stop_after": stop, "epochs": 2},
                args.ranks,
                lose_node_after=stop,
            )
            for name, more in (
                ("a fresh epoch on 1 node x 3 ranks (baseline)", {"run": "fresh"}),
                (
                    "resumed mid-epoch from 2 nodes x 2 ranks on 1 node x 3 ranks",
                    {"run": "resumed", "resume": True},
                ),
            ):
                reports = _launch(folders[:1], {**spec, "epochs": 1, **more}, 3)
                resumes.append((kind, name, max(r["first_batch_s"] for r in reports)))
        shutil.rmtree(tmp, ignore_errors=True)
    _print(args, rows, resumes)
    return 0


def _print(args, rows, resumes) -> None:
    single = rows[0]
    print(
        f"\n## nodes: a decoded-image cache of {args.images} photographs (an eval set: the cache "
        f"and its 64 px eval view), {args.ranks} ranks per node, simulated nodes on one machine\n"
    )
    print(
        "| build | ranks | build time (s) | vs 1 node | image decodes, whole job | vs one process "
        "(2 per image) | disk per node (MB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ranks, seconds, decodes, disk in rows:
        print(
            f"| {name} | {ranks} | {seconds:.1f} | {seconds / single[2]:.2f}x | {decodes:,} | "
            f"{decodes / (2 * args.images):.2f}x | {disk / 1e6:.1f} |"
        )
    scale = _at_imagenet_scale()
    print(
        "\n## nodes: an elastic resume's arithmetic at ImageNet's scale (1,281,000 samples in "
        "1,281 shards, no I/O: a reader that yields numbers), this process\n"
    )
    print(
        "| 2 nodes x 8 ranks x 4 workers stopped after 500 steps of 32, resumed on 3 ranks x 4 "
        "workers | seconds |"
    )
    print("|---|---:|")
    print(
        f"| the rest of the epoch worked out (`resume_after`, the main process) | {scale[0]:.2f} |"
    )
    print(f"| first batch, the rest above included (4 fresh workers) | {scale[1]:.2f} |")
    print(f"| first batch of a fresh epoch on the same loader (baseline) | {scale[2]:.2f} |")
    print(
        "\n## nodes: the first batch after an elastic resume, batch 8 (the same photographs; as "
        f"shards: {args.images} samples of their JPEG bytes, undecoded, through a PrefetchCache "
        "per node)\n"
    )
    print("| data | first batch | seconds |\n|---|---|---:|")
    for kind, name, seconds in resumes:
        print(f"| {RESUMED_DATA[kind]} | {name} | {seconds:.3f} |")


# the resume table's first column, by the kind of data resumed
RESUMED_DATA = {"images": "decoded image cache (threads)", "shards": "ShardSet (1 worker)"}


def _numbers(path, start, stop):
    return range(start, stop)


def _at_imagenet_scale() -> tuple[float, float, float]:
    """(the rest's arithmetic, the resumed first batch, a fresh first batch), in seconds."""
    import warnings

    from torch.utils.data import DataLoader

    dataset = ShardedIterableDataset(
        [f"shard-{i:05d}" for i in range(1281)],
        _numbers,
        shard_lengths=[1000] * 1281,
        rank=0,
        world_size=3,
        split="samples",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataLoader's "4 workers on 2 CPUs"
        start = time.perf_counter()
        rest = dataset.resume_after(0, batch_size=32, num_workers=4, reshaped=[[16, 4, 500, 2]])
        worked_out = time.perf_counter() - start
        next(iter(DataLoader(rest, batch_size=32, num_workers=4)))
        resumed = time.perf_counter() - start
        start = time.perf_counter()
        next(iter(DataLoader(dataset, batch_size=32, num_workers=4)))
        fresh = time.perf_counter() - start
    return worked_out, resumed, fresh


def _write_shards(root: Path, out: Path) -> Path:
    """The photographs as tar shards of their bytes, about 16 per class folder's worth, sorted."""

    files = sorted(root.glob("*/*.jpg"))
    samples = [
        {"__key__": f"{i:05d}", "jpg": f.read_bytes(), "cls": int(f.parent.name.split("_")[-1])}
        for i, f in enumerate(files)
    ]
    size = sum(len(s["jpg"]) for s in samples)
    write_shards(samples, out, shard_bytes=max(1, size // 24), progress=False)
    return out
