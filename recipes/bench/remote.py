"""`recipes bench remote`: reading shards over HTTP: plain streaming, simplecache, PrefetchCache.

Use when: deciding how to read training shards from object storage.
Cost: generates `--shards` shards of `--shard-mb` MB once; serves them from a local HTTP
server with `--latency` per request and `--bandwidth` per connection (object stores cap a
single stream's throughput); one epoch per remote reader; the second PrefetchCache epoch and
local disk, a fraction of a second each, are the best of five runs taken in turns.
Adapt here: latency and bandwidth to your store's; `--prefetch` downloads at once.
Trade-off: loopback has no packet loss or jitter; real stores add both, which favours
prefetching more.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

RECORD_BYTES = 8192
BENCH_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mb", type=float, default=8.0)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request (default 20 ms)")
    parser.add_argument("--bandwidth", type=float, default=16.0, help="MB/s per connection (default 16)")
    parser.add_argument("--prefetch", type=int, default=4, help="PrefetchCache downloads at once")
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: smart_num_workers)")


def read_records(source) -> list:
    """A shard of fixed-size records, each as a uint8 tensor (what a decoder would start from)."""
    import fsspec

    if isinstance(source, str) and "://" in source:
        with fsspec.open(source, "rb") as f:
            return read_records_bytes(f.read())
    return read_records_bytes(Path(source).read_bytes())


def _simplecache_reader(cache_dir: str):
    def read(url: str):
        import fsspec

        with fsspec.open(f"simplecache::{url}", "rb", simplecache={"cache_storage": cache_dir}) as f:
            return read_records_bytes(f.read())

    return read


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
            (root / f"shard-{s:04d}.bin").write_bytes(rng.integers(0, 256, per_shard * RECORD_BYTES, np.uint8).tobytes())
        (root / ".complete").touch()
    return root, per_shard


def compare(folder: Path, per_shard: int, *, latency=0.02, bandwidth_mb=16.0, prefetch=4, workers=1):
    from torch.utils.data import DataLoader

    from recipes.bench.measure import measure
    from recipes.common import PrefetchCache, ShardedIterableDataset, worker_init
    from recipes.testing import LocalHTTPServer

    names = sorted(p.name for p in folder.glob("shard-*.bin"))
    lengths = [per_shard] * len(names)

    def run(name, shards, reader, cache=None, epoch=0):
        ds = ShardedIterableDataset(shards, reader, shard_lengths=lengths, seed=0, cache=cache)
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=64, num_workers=workers, worker_init_fn=worker_init if workers else None)
        return measure(name, loader)

    with LocalHTTPServer(folder, latency=latency, bandwidth=bandwidth_mb * 2**20) as server, \
            tempfile.TemporaryDirectory(prefix="recipes-bench-remote-") as tmp:
        urls = [server.url(n) for n in names]
        cache = PrefetchCache(Path(tmp) / "prefetch", max_bytes=2 * len(names) * per_shard * RECORD_BYTES,
                              prefetch=prefetch)
        rows = [
            run("fsspec streaming (baseline)", urls, read_records),
            run("fsspec simplecache, epoch 1", urls, _simplecache_reader(str(Path(tmp) / "simple"))),
            run("PrefetchCache, epoch 1", urls, read_records, cache=cache),
            *_best_interleaved(
                lambda: run("PrefetchCache, epoch 2", urls, read_records, cache=cache, epoch=0),
                lambda: run("local disk", [str(folder / n) for n in names], read_records),
            ),
        ]
    return rows


def _best_interleaved(*measurers, repeat: int = 5):
    """Best of `repeat` runs of each, taken in turns: warm epochs last ~0.1 s, so scheduling
    noise and drifting clocks would otherwise decide the comparison."""
    runs = [[] for _ in measurers]
    for _ in range(repeat):
        for results, measure_once in zip(runs, measurers, strict=True):
            results.append(measure_once())
    return [max(results, key=lambda m: m.items_per_s) for results in runs]


def run(args: argparse.Namespace) -> int:
    from recipes.bench.measure import format_table
    from recipes.common import smart_num_workers

    folder, per_shard = ensure_shards(args.shards, args.shard_mb)
    workers = smart_num_workers() if args.workers is None else args.workers
    rows = compare(folder, per_shard, latency=args.latency, bandwidth_mb=args.bandwidth, prefetch=args.prefetch,
                   workers=workers)
    print(f"\n## remote: {args.shards} shards of {per_shard * RECORD_BYTES / 2**20:.1f} MiB over HTTP on 127.0.0.1, "
          f"{args.latency * 1000:.0f} ms per request, {args.bandwidth:g} MB/s per connection, {workers} workers\n")
    print(format_table(rows, unit="samples/s", whole_epoch=True))
    simple, first, second, local = (rows[i].items_per_s for i in (1, 2, 3, 4))
    whole_simple, whole_first = (rows[i].items / rows[i].seconds for i in (1, 2))
    print(f"\nPrefetchCache epoch 1 vs simplecache: {first / simple:.2f}x steady, {whole_first / whole_simple:.2f}x "
          f"over the whole epoch (first batch included); epoch 2 vs local disk: {second / local:.0%}")
    return 0
