"""The shuffle-quality table of `recipes bench shards`: what a model trained through the shard
path sees. The folder, listed in sorted order (so by class), written as the README writes it (a
stream), read back per configuration, two epochs of labels (no decoding): per batch the distinct
labels and the most common label's share, against an i.i.d. permutation of the same labels.

Use when: choosing shard sizes and `shuffle_window` for data stored sorted by class.
Cost: one `write_shards` per row of `CONFIGS` into `out`, then two epochs of labels each.
Adapt here: `CONFIGS` (the rows), `BATCH`.
Trade-off: labels only, so the table shows the mix, not a model's accuracy.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from recipes.bench.harness.workers import worker_init_for
from recipes.commands.shards_cmd import image_folder_samples
from recipes.common import write_shards

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
            worker_init_fn=worker_init_for(workers),
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
        differs = "no"
        if differ:
            differs = "yes"
        print(
            f"| {name} | {count} | {distinct:.1f} | {distinct / iid_distinct:.0%} | {majority:.0%} "
            f"| {majority / iid_majority:.2f}x | {differs} |"
        )
    print(
        f"| i.i.d. permutation of the same labels | | {iid_distinct:.1f} | 100% | "
        f"{iid_majority:.0%} | 1.00x | yes |"
    )
