"""`recipes bench common`: copy-on-read growth of forked workers, Python list vs PackedStrings.

Use when: deciding whether a dataset's index must leave Python lists (it must, past ~100k
entries with forked workers).
Cost: builds `--paths` strings twice and runs one pass per layout with 2 forked workers
(about 10 s for a million paths on 2 cores).
Adapt here: `_fake_paths` mimics ImageNet paths; point it at your own index.
Trade-off: measures growth in one pass; long runs with more workers grow proportionally more.
"""

from __future__ import annotations

import argparse
import gc

from recipes.bench.harness.bench_charts import Chart, write_chart
from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.workers.worker_memory import measure_worker_memory_growth


class PathsDataset:
    """A dataset whose items are the lengths of its stored paths (reads every path once)."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> int:
        return len(self.paths[index])


def _fake_paths(n: int) -> list[str]:
    return [f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i:07d}.JPEG" for i in range(n)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paths", type=int, default=1_000_000, help="paths in the index")
    parser.add_argument("--workers", type=int, default=2, help="forked DataLoader workers")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `recipes --help` and its errors stay free of torch.

    paths = _fake_paths(args.paths)
    packed = PackedStrings(paths)
    rows = []
    for name, index in (("Python list[str] (baseline)", paths), ("PackedStrings", packed)):
        gc.collect()
        growth = measure_worker_memory_growth(PathsDataset(index), num_workers=args.workers)
        rows.append((name, sum(growth) / len(growth)))
    del paths
    base = rows[0][1]
    heading = (
        f"common: worker memory growth over one pass ({args.paths:,} paths, "
        f"{args.workers} forked workers)"
    )
    print(f"\n## {heading}\n")
    print("| index layout | USS growth per worker (MiB) | vs baseline |")
    print("|---|---:|---:|")
    for name, growth in rows:
        ratio = growth / base if base > 0 else float("nan")
        print(f"| {name} | {growth / 2**20:,.1f} | {ratio:.3f}x |")
    write_chart(
        Chart(
            "common-worker-memory",
            heading,
            "USS growth per worker (MiB)",
            tuple(n for n, _ in rows),
            tuple(g / 2**20 for _, g in rows),
            ratio_format="{:.3f}x",
        ),
        getattr(args, "plot", None),
    )
    return 0
