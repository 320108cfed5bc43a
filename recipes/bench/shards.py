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
import contextlib
import importlib.util
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np


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


def _have(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def write_rows(
    root: Path, out: Path, shard_bytes: int, repeat: int = 3
) -> tuple[list[tuple[str, float, str]], list[str]]:
    """`(name, samples/s, output)` for each writer, one process each, and notes. Ours and
    webdataset's are the best of `repeat` writes, taken in turns: a write lasts a fraction of a
    second, and how long an fsync waits depends on what else the disk is flushing."""
    import shutil

    from recipes.common import write_shards
    from recipes.shards_cmd import image_folder_samples

    samples = image_folder_samples(root)
    n = len(samples)
    rows = []
    notes = []
    best = {"ours": 0.0, "wds": 0.0}
    wds = None
    if _have("webdataset"):
        import webdataset as wds
    else:
        notes.append("webdataset rows left out: pip install webdataset")
    for turn in range(repeat):
        last = turn == repeat - 1  # the last turn's shards stay, for the read rows
        target = out / ("ours" if last else f".ours-{turn}")
        start = time.perf_counter()
        write_shards(samples, target, shard_bytes=shard_bytes, progress=False)
        best["ours"] = max(best["ours"], n / (time.perf_counter() - start))
        if wds is not None:
            folder = out / ("wds" if last else f".wds-{turn}")
            folder.mkdir()
            start = time.perf_counter()
            with wds.ShardWriter(
                str(folder / "shard-%06d.tar"), maxsize=shard_bytes, verbose=0
            ) as sink:
                for sample in samples:
                    sink.write(sample)
            best["wds"] = max(best["wds"], n / (time.perf_counter() - start))
        if not last:
            for folder in (out / f".ours-{turn}", out / f".wds-{turn}"):
                shutil.rmtree(folder, ignore_errors=True)
    rows.append(("recipes write_shards (tar + index)", best["ours"], "ours"))
    if wds is not None:
        rows.append(("webdataset ShardWriter (tar)", best["wds"], "wds"))
    if _have("litdata"):
        import litdata

        start = time.perf_counter()
        litdata.optimize(
            fn=_LitSample(samples),
            inputs=list(range(n)),
            output_dir=str(out / "lit"),
            chunk_bytes=shard_bytes,
            num_workers=1,
            verbose=False,
            start_method="fork",
        )
        rows.append(("LitData optimize (1 worker)", n / (time.perf_counter() - start), "lit"))
    else:
        notes.append("LitData rows left out: pip install litdata")
    return rows, notes


class _LitSample:
    """`optimize`'s function: index to the sample's encoded bytes and label (no decoding)."""

    def __init__(self, samples):
        self.samples = samples

    def __call__(self, index):
        sample = self.samples[index]
        field = next(k for k in sample if k not in ("__key__", "cls"))
        return {"key": sample["__key__"], "data": sample[field], "cls": sample["cls"]}


class _Epochs:
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
    return len(batch["__key__"] if "__key__" in batch else batch["key"])


def read_rows(out: Path, *, latency: float, bandwidth: float, workers: int, repeat: int = 3):
    """Measurements: ours epoch 1 and 2 over S3 (PrefetchCache), webdataset over HTTP, LitData
    over S3 epochs 1 and 2, and ours from local disk."""
    from torch.utils.data import DataLoader

    from recipes.bench.harness.measure import best_interleaved
    from recipes.bench.harness.measure import measure as measure_items
    from recipes.common import PrefetchCache, ShardSet, worker_init

    def measure(name, batches):
        return measure_items(name, batches, counter=count_samples)

    from recipes.testing_servers import LocalHTTPServer, s3_store_process

    names = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.parts[len(out.parts)] in ("ours", "lit")
    )
    settings = dict(
        batch_size=64, num_workers=workers, worker_init_fn=worker_init if workers else None
    )
    rows = []
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
        rows.append(
            measure(
                "recipes ShardSet + PrefetchCache over S3, epoch 1",
                _Epochs(lambda: DataLoader(ours, **settings)),
            )
        )
        in_order_cache = PrefetchCache(
            Path(tmp) / "prefetch-in-order", max_bytes=cache.max_bytes, storage_options=options
        )
        in_order_cache.connect(shards.urls[0])
        in_order = shards.dataset(cache=in_order_cache, seed=0, shuffle_window=0)
        rows.append(
            measure(
                "recipes ShardSet + PrefetchCache over S3, epoch 1, shard order only",
                _Epochs(lambda: DataLoader(in_order, **settings)),
            )
        )
        if (out / "wds").exists():
            import webdataset as wds

            server = stack.enter_context(
                LocalHTTPServer(out / "wds", latency=latency, bandwidth=bandwidth)
            )
            urls = [server.url(p.name) for p in sorted((out / "wds").glob("*.tar"))]
            rows.append(
                measure(
                    "webdataset.WebDataset over HTTP (curl), epoch 1",
                    _Epochs(
                        lambda: DataLoader(
                            wds.WebDataset(urls, shardshuffle=False, empty_check=False), **settings
                        )
                    ),
                )
            )
        lit = None
        if (out / "lit").exists():
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
            lit = litdata.StreamingDataset(
                "s3://bench/lit", storage_options=lit_options, cache_dir=str(Path(tmp) / "litcache")
            )
            rows.append(
                measure(
                    "LitData StreamingDataset over S3, epoch 1",
                    _Epochs(
                        lambda: litdata.StreamingDataLoader(lit, batch_size=64, num_workers=workers)
                    ),
                )
            )
        local = ShardSet.open(out / "ours").dataset(seed=0)
        local_in_order = ShardSet.open(out / "ours").dataset(seed=0, shuffle_window=0)
        unchecked_set = ShardSet.open("s3://bench/ours", storage_options=options)
        unchecked_local_set = ShardSet.open(out / "ours")
        unchecked_set.checksums = unchecked_local_set.checksums = (
            None  # the bench's switch: checks off
        )
        unchecked = unchecked_set.dataset(cache=cache, seed=0)
        unchecked_local = unchecked_local_set.dataset(seed=0)
        second = [
            lambda: measure(
                "recipes ShardSet + PrefetchCache over S3, epoch 2",
                _Epochs(lambda: DataLoader(ours, **settings), epoch=1),
            ),
            lambda: measure(
                "recipes ShardSet from local disk", _Epochs(lambda: DataLoader(local, **settings))
            ),
            lambda: measure(
                "recipes ShardSet from local disk, shard order only",
                _Epochs(lambda: DataLoader(local_in_order, **settings)),
            ),
            lambda: measure(
                "recipes ShardSet + PrefetchCache over S3, epoch 2, checksums off",
                _Epochs(lambda: DataLoader(unchecked, **settings), epoch=1),
            ),
            lambda: measure(
                "recipes ShardSet from local disk, checksums off",
                _Epochs(lambda: DataLoader(unchecked_local, **settings)),
            ),
        ]
        if lit is not None:
            second.append(
                lambda: measure(
                    "LitData StreamingDataset over S3, epoch 2",
                    _Epochs(
                        lambda: litdata.StreamingDataLoader(lit, batch_size=64, num_workers=workers)
                    ),
                )
            )
        rows += best_interleaved(*second, repeat=repeat)
    return rows


def run(args: argparse.Namespace) -> int:
    from recipes.bench.harness.bench_charts import Chart, write_chart
    from recipes.bench.harness.measure import show_table
    from recipes.bench.vision import ensure_data
    from recipes.common import smart_num_workers

    root = ensure_data(args.images)
    workers = smart_num_workers() if args.workers is None else args.workers
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
        baseline=1 if len(rows) > 3 else 0,
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


# ---- shuffle quality: what a model trained through the shard path sees ----------------------
# The folder, listed in sorted order (so by class), written as the README writes it (a stream),
# read back per configuration, two epochs of labels (no decoding): per batch the distinct labels
# and the most common label's share, against an i.i.d. permutation of the same labels.
BATCH = 32
# (row name, shard bytes, write_shards' shuffle, ShardSet.dataset's shuffle_window)
CONFIGS = (
    ("README's way, 64 MiB shards (the default)", 64 * 2**20, True, 16),
    ("README's way, 256 KiB shards (the README's)", 256 * 2**10, True, 16),
    ("sorted shards (shuffle=False), 256 KiB, window 16", 256 * 2**10, False, 16),
    ("sorted shards, 1 MiB, window 16: read-side mixing alone", 2**20, False, 16),
    ("sorted shards, 1 MiB, shard order only (before)", 2**20, False, 0),
    ("sorted shards, 64 MiB, shard order only (before)", 64 * 2**20, False, 0),
)


def label_of(sample: dict) -> int:
    return int(sample["cls"])


def batch_mix(batches) -> tuple[float, float]:
    """(mean distinct labels per full batch, mean share of its most common label)."""
    full = [list(b) for b in batches if len(b) == BATCH]
    distinct = float(np.mean([len(set(b)) for b in full]))
    majority = float(np.mean([Counter(b).most_common(1)[0][1] / BATCH for b in full]))
    return distinct, majority


def iid_mix(labels, rounds: int = 200, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    full = len(labels) // BATCH * BATCH
    runs = [
        batch_mix(rng.permutation(labels)[:full].reshape(-1, BATCH).tolist()) for _ in range(rounds)
    ]
    return float(np.mean([r[0] for r in runs])), float(np.mean([r[1] for r in runs]))


def quality_rows(root: Path, out: Path, workers: int) -> tuple[list[tuple], tuple[float, float]]:
    """`[(name, shards, distinct, majority, epochs differ)]` and the i.i.d. reference."""
    from torch.utils.data import DataLoader

    from recipes.common import worker_init, write_shards
    from recipes.shards_cmd import image_folder_samples

    samples = image_folder_samples(root)
    labels = [label for _, label in samples.files]
    rows = []
    for k, (name, shard_bytes, shuffle, window) in enumerate(CONFIGS):
        shards = write_shards(
            iter(samples),
            out / f"mix-{k}",
            shard_bytes=shard_bytes,
            shuffle=shuffle,
            progress=False,
        )
        ds = shards.dataset(shuffle=True, shuffle_window=window, transform=label_of)
        loader = DataLoader(
            ds,
            batch_size=BATCH,
            num_workers=workers,
            worker_init_fn=worker_init if workers else None,
        )
        epochs = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            epochs.append([batch.tolist() for batch in loader])
        distinct, majority = batch_mix(epochs[0] + epochs[1])
        rows.append((name, len(shards.entries), distinct, majority, epochs[0] != epochs[1]))
    return rows, iid_mix(labels)


def show_quality(rows, iid, heading: str) -> None:
    iid_distinct, iid_majority = iid
    print(f"\n## {heading}\n")
    print(
        "| shards written and read | shards | distinct classes per batch | vs i.i.d. | majority "
        "share | vs i.i.d. | epochs differ |\n|---|---:|---:|---:|---:|---:|---|"
    )
    for name, count, distinct, majority, differ in rows:
        print(
            f"| {name} | {count} | {distinct:.1f} | {distinct / iid_distinct:.0%} | {majority:.0%} "
            f"| {majority / iid_majority:.2f}x | {'yes' if differ else 'no'} |"
        )
    print(
        f"| i.i.d. permutation of the same labels | | {iid_distinct:.1f} | 100% | "
        f"{iid_majority:.0%} | 1.00x | yes |"
    )
