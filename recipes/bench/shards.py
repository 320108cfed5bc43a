"""`recipes bench shards`: writing an image folder as shards (write_shards against webdataset's
ShardWriter and LitData's optimize) and reading them back over a remote store, epochs 1 and 2
(ShardSet + PrefetchCache against webdataset.WebDataset and LitData's StreamingDataset).

Use when: choosing how to store and stream a dataset of encoded files.
Cost: the vision bench's generated JPEGs (`--images`), written three ways into a temp folder
(one process each); then one epoch per remote reader and the second epochs, served by moto's S3
server behind the latency- and bandwidth-capping proxy of `recipes bench remote --s3` (ours and
LitData's), and by the HTTP server with the same caps for webdataset (which reads URLs through
curl; it has no S3 client of its own without the AWS CLI).
Adapt here: `--shard-mb`, `--latency`, `--bandwidth`, `--workers`.
Trade-off: the peers are measured only when installed (`pip install webdataset litdata`); their
rows are left out otherwise, and the output says so. Reading counts samples (dicts of the
encoded bytes), no decoding: the transport and the reader are what differ. The rows "checksums
off" read the same shards with the per-sample checks of `recipes.common.shards.shard_checks`
turned off (a `ShardSet` whose `checksums` is None, as a v1 index's), interleaved with the rows
that check: the checks' cost, on the paths where reading is not held up by the network. The
rows "shard order only" read with `shuffle_window=0` (each shard front to back): the cost of
sample-level mixing. Then the shuffle-quality table (`quality_rows`): the class mix of
batches read back from the folder written in its sorted order, against an i.i.d. shuffle.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from recipes.bench.harness.bench_charts import Chart, write_chart
from recipes.bench.harness.measure import show_table
from recipes.bench.harness.workers import chosen_workers
from recipes.bench.images.data import ensure_data
from recipes.bench.storage.quality import BATCH, quality_rows, show_quality
from recipes.bench.storage.reads import read_rows
from recipes.bench.storage.writes import write_rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--images", type=int, default=800, help="generated JPEGs (the vision bench's)"
    )
    parser.add_argument("--shard-mb", type=float, default=8.0, help="shard size in MiB (default 8)")
    parser.add_argument(
        "--latency", type=float, default=0.02, help="seconds per request (default 20 ms)"
    )
    parser.add_argument(
        "--bandwidth", type=float, default=16.0, help="MB/s per connection (default 16)"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: smart_num_workers)"
    )


def run(args: argparse.Namespace) -> int:
    root = ensure_data(args.images)
    workers = chosen_workers(args.workers)
    shard_bytes = int(args.shard_mb * 2**20)
    with tempfile.TemporaryDirectory(prefix="recipes-bench-shards-") as tmp:
        out = Path(tmp)
        written, notes = write_rows(root, out, shard_bytes)
        heading = (
            f"shards: writing {args.images} JPEGs from {root} as {args.shard_mb:g} MiB shards, "
            "one process"
        )
        print(f"\n## {heading}\n")
        print("| writer | samples/s | vs write_shards |\n|---|---:|---:|")
        for name, rate, _ in written:
            print(f"| {name} | {rate:,.0f} | {rate / written[0][1]:.2f}x |")
        write_chart(
            Chart(
                "shards-write",
                heading,
                "samples/s",
                tuple(w[0] for w in written),
                tuple(w[1] for w in written),
            ),
            getattr(args, "plot", None),
        )
        rows = read_rows(
            out, latency=args.latency, bandwidth=args.bandwidth * 2**20, workers=workers
        )
        mixing, iid = quality_rows(root, out, workers)
    show_table(
        f"shards: reading them back, {args.latency * 1000:.0f} ms per request, {args.bandwidth:g} "
        f"MB/s per connection, {workers} workers, batches of 64 (webdataset's row is the baseline)",
        rows,
        unit="samples/s",
        whole_epoch=True,
        baseline=_baseline(rows),
        plot=getattr(args, "plot", None),
        name="shards-read",
    )
    show_quality(
        mixing,
        iid,
        f"shards: shuffle quality, {args.images} JPEGs of 10 classes listed in sorted order, "
        f"written as a stream as the README does, read with the defaults, {workers} workers, "
        f"batches of {BATCH}, epochs 1 and 2",
    )
    for note in notes:
        print(f"\n{note}")
    return 0


def _baseline(rows) -> int:
    """The index of the read table's baseline row: 1 when more than three rows were measured,
    else the first."""
    if len(rows) > 3:
        return 1
    return 0
