"""The read rows of `recipes bench shards`: the shards read back over a remote store, epochs 1
and 2 (ShardSet + PrefetchCache against webdataset.WebDataset and LitData's StreamingDataset),
and from local disk, with and without the per-sample checks and the sample-level mixing.

Use when: reading how `recipes bench shards`' second table is measured (`read_rows`).
Cost: moto's S3 server behind the latency- and bandwidth-capping proxy of `recipes bench remote
--s3` (ours and LitData's), the HTTP server with the same caps for webdataset (which reads URLs
through curl); one first epoch per reader, then the second epochs, best of `repeat`, in turns.
Adapt here: the rows of `_first_epochs` and `_second_epochs`.
Trade-off: reading counts samples (dicts of the encoded bytes), no decoding: the transport and
the reader are what differ. The rows "checksums off" read the same shards with the per-sample
checks of `recipes.common.shards.shard_checks` turned off (a `ShardSet` whose `checksums` is
None, as a v1 index's), interleaved with the rows that check; the rows "shard order only" read
with `shuffle_window=0` (each shard front to back): the cost of sample-level mixing.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path

from torch.utils.data import DataLoader

from recipes.bench.harness.measure import best_interleaved
from recipes.bench.harness.measure import measure as measure_items
from recipes.bench.harness.workers import worker_init_for
from recipes.common import PrefetchCache, ShardSet
from recipes.testing_servers import LocalHTTPServer, s3_store_process


class Epochs:
    """An epoch of a DataLoader (batches of 64) over `dataset`, `set_epoch(epoch)` first when it has
    one."""

    def __init__(self, make, epoch: int = 0):
        self.make = make
        self.epoch = epoch

    def __iter__(self):
        loader = self.make()
        dataset = getattr(loader, "dataset", None)
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.epoch)
        return iter(loader)


def count_samples(batch) -> int:
    """Samples in a collated batch of sample dicts (ours and webdataset's `__key__`, LitData's
    `key`)."""
    if "__key__" in batch:
        return len(batch["__key__"])
    return len(batch["key"])


def measure(name: str, batches):
    return measure_items(name, batches, counter=count_samples)


def _epochs(dataset, settings: dict, epoch: int = 0) -> Epochs:
    return Epochs(functools.partial(DataLoader, dataset, **settings), epoch=epoch)


def _lit_epochs(lit, workers: int) -> Epochs:
    import litdata

    return Epochs(
        functools.partial(litdata.StreamingDataLoader, lit, batch_size=64, num_workers=workers)
    )


def read_rows(out: Path, *, latency: float, bandwidth: float, workers: int, repeat: int = 3):
    """Measurements: ours epoch 1 and 2 over S3 (PrefetchCache), webdataset over HTTP, LitData
    over S3 epochs 1 and 2, and ours from local disk."""
    names = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.parts[len(out.parts)] in ("ours", "lit")
    )
    settings = dict(batch_size=64, num_workers=workers, worker_init_fn=worker_init_for(workers))
    with (
        s3_store_process(
            out, names, bucket="bench", latency=latency, bandwidth=bandwidth
        ) as options,
        tempfile.TemporaryDirectory(prefix="recipes-bench-shards-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        shards = ShardSet.open("s3://bench/ours", storage_options=options)
        cache = PrefetchCache(
            Path(tmp) / "prefetch",
            max_bytes=4 * sum(e["bytes"] for e in shards.entries),
            storage_options=options,
        )
        cache.connect(shards.urls[0])  # the client's setup, timed apart (as the peers' are)
        ours = shards.dataset(cache=cache, seed=0)
        rows = _first_epochs(Path(tmp), shards, ours, cache, options, settings)
        if (out / "wds").exists():
            server = stack.enter_context(
                LocalHTTPServer(out / "wds", latency=latency, bandwidth=bandwidth)
            )
            rows.append(_webdataset_row(out, server, settings))
        lit = None
        if (out / "lit").exists():
            lit = _litdata_dataset(options, Path(tmp) / "litcache")
            rows.append(
                measure("LitData StreamingDataset over S3, epoch 1", _lit_epochs(lit, workers))
            )
        second = _second_epochs(out, ours, cache, options, settings)
        if lit is not None:
            second.append(
                functools.partial(
                    measure, "LitData StreamingDataset over S3, epoch 2", _lit_epochs(lit, workers)
                )
            )
        rows += best_interleaved(*second, repeat=repeat)
    return rows


def _first_epochs(tmp: Path, shards, ours, cache, options: dict, settings: dict) -> list:
    """Ours over S3, epoch 1: shuffled, then in shard order only (a cache of its own, in
    `tmp`)."""
    rows = [measure("recipes ShardSet + PrefetchCache over S3, epoch 1", _epochs(ours, settings))]
    in_order_cache = PrefetchCache(
        tmp / "prefetch-in-order", max_bytes=cache.max_bytes, storage_options=options
    )
    in_order_cache.connect(shards.urls[0])
    in_order = shards.dataset(cache=in_order_cache, seed=0, shuffle_window=0)
    rows.append(
        measure(
            "recipes ShardSet + PrefetchCache over S3, epoch 1, shard order only",
            _epochs(in_order, settings),
        )
    )
    return rows


def _webdataset_row(out: Path, server, settings: dict):
    """webdataset.WebDataset over HTTP (curl), epoch 1."""
    import webdataset as wds

    urls = [server.url(p.name) for p in sorted((out / "wds").glob("*.tar"))]
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    return measure("webdataset.WebDataset over HTTP (curl), epoch 1", _epochs(dataset, settings))


def _litdata_dataset(options: dict, cache_dir: Path):
    """LitData's StreamingDataset over the same S3 store."""
    import litdata
    import litdata.streaming.downloader as lit_downloader

    # LitData downloads through obstore, which refuses plain-HTTP endpoints unless told;
    # the store here is moto on loopback (for the benchmark only)
    if isinstance(getattr(lit_downloader, "_OBSTORE_CLIENT_OPTIONS", None), dict):
        lit_downloader._OBSTORE_CLIENT_OPTIONS = {
            **lit_downloader._OBSTORE_CLIENT_OPTIONS,
            "allow_http": True,
        }
    lit_options = {
        "endpoint_url": options["client_kwargs"]["endpoint_url"],
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }
    return litdata.StreamingDataset(
        "s3://bench/lit", storage_options=lit_options, cache_dir=str(cache_dir)
    )


def _second_epochs(out: Path, ours, cache, options: dict, settings: dict) -> list:
    """The rows measured in turns: ours over S3 epoch 2 and from local disk, each also in shard
    order only or with the checksums off."""
    local = ShardSet.open(out / "ours").dataset(seed=0)
    local_in_order = ShardSet.open(out / "ours").dataset(seed=0, shuffle_window=0)
    unchecked_set = ShardSet.open("s3://bench/ours", storage_options=options)
    unchecked_local_set = ShardSet.open(out / "ours")
    # the bench's switch: checks off
    unchecked_set.checksums = None
    unchecked_local_set.checksums = None
    unchecked = unchecked_set.dataset(cache=cache, seed=0)
    unchecked_local = unchecked_local_set.dataset(seed=0)
    rows = (
        (
            "recipes ShardSet + PrefetchCache over S3, epoch 2",
            _epochs(ours, settings, epoch=1),
        ),
        ("recipes ShardSet from local disk", _epochs(local, settings)),
        (
            "recipes ShardSet from local disk, shard order only",
            _epochs(local_in_order, settings),
        ),
        (
            "recipes ShardSet + PrefetchCache over S3, epoch 2, checksums off",
            _epochs(unchecked, settings, epoch=1),
        ),
        ("recipes ShardSet from local disk, checksums off", _epochs(unchecked_local, settings)),
    )
    return [functools.partial(measure, name, epochs) for name, epochs in rows]
