"""`recipes bench remote`: reading shards from a remote store: plain streaming, simplecache,
PrefetchCache, over whole epochs (first batch included).

Use when: deciding how to read training shards from object storage.
Cost: generates `--shards` shards of `--shard-mb` MB once; serves them from a local HTTP
server, or with `--s3` from moto's S3 server behind a proxy, with `--latency` per request
and `--bandwidth` per connection (object stores cap a single stream's throughput); one epoch
per remote reader; the second PrefetchCache epoch and local disk, a fraction of a second
each, are the best of five runs taken in turns.
Adapt here: latency and bandwidth to your store's; `--prefetch` downloads at once.
Trade-off: loopback has no packet loss or jitter; real stores add both, which favours
prefetching more. Every epoch is timed from `set_epoch` on, so PrefetchCache's early start
(downloads begun in the main process before the workers fork) is counted, not hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from recipes.bench.harness.measure import best_interleaved, measure, show_table
from recipes.bench.harness.workers import chosen_workers, worker_init_for
from recipes.common import PrefetchCache, ShardedIterableDataset
from recipes.testing_servers import LocalHTTPServer, s3_store_process

RECORD_BYTES = 8192
BENCH_VERSION = 1
BUCKET = "recipes-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mb", type=float, default=8.0)
    parser.add_argument(
        "--latency", type=float, default=0.02, help="seconds per request (default 20 ms)"
    )
    parser.add_argument(
        "--bandwidth", type=float, default=16.0, help="MB/s per connection (default 16)"
    )
    parser.add_argument("--prefetch", type=int, default=4, help="PrefetchCache downloads at once")
    parser.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: smart_num_workers)"
    )
    parser.add_argument(
        "--s3",
        action="store_true",
        help="serve from moto's S3 server (through s3fs) behind a latency- and bandwidth-capping "
        "proxy, instead of the HTTP server",
    )


def read_records(source, storage_options: dict | None = None) -> list:
    """A shard of fixed-size records, each as a uint8 tensor (what a decoder would start from)."""
    import fsspec

    if isinstance(source, str) and "://" in source:
        with fsspec.open(source, "rb", **(storage_options or {})) as f:
            return read_records_bytes(f.read())
    return read_records_bytes(Path(source).read_bytes())


def _read_simplecache(url: str, cache_dir: str, storage_options: dict) -> list:
    import fsspec

    protocol = url.split("://", 1)[0]
    with fsspec.open(
        f"simplecache::{url}",
        "rb",
        simplecache={"cache_storage": cache_dir},
        **{protocol: storage_options},
    ) as f:
        return read_records_bytes(f.read())


def read_records_bytes(data: bytes) -> list:
    import torch

    return list(torch.from_numpy(np.frombuffer(data, np.uint8).reshape(-1, RECORD_BYTES).copy()))


def ensure_shards(count: int, shard_mb: float) -> tuple[Path, int]:
    """(folder, records per shard) of generated shards, built once."""
    per_shard = max(1, int(shard_mb * 2**20) // RECORD_BYTES)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recipes" / "bench"
    root = base / f"remote-v{BENCH_VERSION}-{count}x{per_shard}"
    if not (root / ".complete").exists():
        root.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for s in range(count):
            (root / f"shard-{s:04d}.bin").write_bytes(
                rng.integers(0, 256, per_shard * RECORD_BYTES, np.uint8).tobytes()
            )
        (root / ".complete").touch()
    return root, per_shard


@contextlib.contextmanager
def served(folder: Path, names: list[str], *, latency: float, bandwidth: float, s3: bool = False):
    """(urls, storage_options) of the shards behind a store with `latency` per request and
    `bandwidth` bytes/s per connection: the HTTP server (in this process), or moto's S3 behind
    a proxy (in a process of their own)."""

    if not s3:
        with LocalHTTPServer(folder, latency=latency, bandwidth=bandwidth) as server:
            yield [server.url(n) for n in names], {}
        return
    with s3_store_process(
        folder, names, bucket=BUCKET, latency=latency, bandwidth=bandwidth
    ) as options:
        yield [f"s3://{BUCKET}/{name}" for name in names], options


class _Epoch:
    """One epoch of `dataset` through a fresh DataLoader, timed from `set_epoch` on."""

    def __init__(self, dataset, epoch: int, workers: int):
        self.dataset = dataset
        self.epoch = epoch
        self.workers = workers

    def __iter__(self):
        from torch.utils.data import DataLoader

        self.dataset.set_epoch(self.epoch)
        return iter(
            DataLoader(
                self.dataset,
                batch_size=64,
                num_workers=self.workers,
                worker_init_fn=worker_init_for(self.workers),
            )
        )


def compare(
    folder: Path,
    per_shard: int,
    *,
    latency=0.02,
    bandwidth_mb=16.0,
    prefetch=4,
    workers=1,
    s3=False,
    repeat: int = 5,
):
    """Rows: streaming (baseline), simplecache epoch 1, PrefetchCache epoch 1, PrefetchCache
    epoch 2, local disk; and the PrefetchCache's `concurrency()` after epoch 1."""

    names = sorted(p.name for p in folder.glob("shard-*.bin"))
    lengths = [per_shard] * len(names)

    def run(name, shards, reader, cache=None, epoch=0):
        ds = ShardedIterableDataset(shards, reader, shard_lengths=lengths, seed=0, cache=cache)
        return measure(name, _Epoch(ds, epoch, workers))

    with (
        served(folder, names, latency=latency, bandwidth=bandwidth_mb * 2**20, s3=s3) as (
            urls,
            options,
        ),
        tempfile.TemporaryDirectory(prefix="recipes-bench-remote-") as tmp,
    ):
        remote = functools.partial(read_records, storage_options=options)
        cache = PrefetchCache(
            Path(tmp) / "prefetch",
            max_bytes=2 * len(names) * per_shard * RECORD_BYTES,
            prefetch=prefetch,
            storage_options=options,
        )
        began = time.perf_counter()
        cache.connect(urls[0])  # setup, timed apart (as the LitData and Streaming anchors are)
        setup = time.perf_counter() - began
        rows = [
            run("fsspec streaming (baseline)", urls, remote),
            run(
                "fsspec simplecache, epoch 1",
                urls,
                functools.partial(
                    _read_simplecache, cache_dir=str(Path(tmp) / "simple"), storage_options=options
                ),
            ),
            run("PrefetchCache, epoch 1", urls, read_records, cache=cache),
        ]
        level = cache.concurrency()
        rows += best_interleaved(
            lambda: run("PrefetchCache, epoch 2", urls, read_records, cache=cache, epoch=0),
            lambda: run("local disk", [str(folder / n) for n in names], read_records),
            repeat=repeat,
        )
    return rows, {**level, "setup_seconds": setup}


def run(args: argparse.Namespace) -> int:
    folder, per_shard = ensure_shards(args.shards, args.shard_mb)
    workers = chosen_workers(args.workers)
    rows, level = compare(
        folder,
        per_shard,
        latency=args.latency,
        bandwidth_mb=args.bandwidth,
        prefetch=args.prefetch,
        workers=workers,
        s3=args.s3,
    )
    store = "S3 (moto through s3fs, behind a proxy)" if args.s3 else "HTTP"
    show_table(
        f"remote: {args.shards} shards of {per_shard * RECORD_BYTES / 2**20:.1f} MiB over {store} "
        f"on 127.0.0.1, {args.latency * 1000:.0f} ms per request, {args.bandwidth:g} MB/s per "
        f"connection, {workers} workers",
        rows,
        unit="samples/s",
        whole_epoch=True,
        plot=getattr(args, "plot", None),
        name="remote-s3" if args.s3 else "remote-http",
    )
    simple, first, second, local = (rows[i].items_per_s for i in (1, 2, 3, 4))
    whole_simple, whole_first = (rows[i].items / rows[i].seconds for i in (1, 2))
    print(
        f"\nPrefetchCache epoch 1 vs simplecache: {first / simple:.2f}x steady, "
        f"{whole_first / whole_simple:.2f}x over the whole epoch (first batch included); epoch 2 "
        f"vs local disk: {second / local:.0%}; downloads at once: {level['objects']}, ranges per "
        f"object in flight: {level['ranges_per_object']}; PrefetchCache setup (`connect`: import "
        f"and client, before its epochs): {level['setup_seconds']:.2f} s"
    )
    return 0
