"""The warm path's per-image costs, printed under `recipes bench vision`'s eval table: reading
the eval view, reading a train crop's rows, resizing it into its batch row, mirroring, and
handing a finished batch over (a DataLoader worker's shared-memory batch against a thread's).

Use when: finding which step of the warm path to work on next.
Cost: `images` reads, crops and resizes in one thread, then three passes of empty batches
through one worker and one thread.
Adapt here: `images` (how many are timed), the rows of the Markdown table.
Trade-off: one thread (torch too), so the figures are costs, not the loaders' rates.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from recipes.common import ThreadLoader
from recipes.vision.batches.batch_buffers import new_uint8_batch
from recipes.vision.decoding.crop import random_resized_box
from recipes.vision.decoding.decode import _opencv, resize_uint8


class EmptyBatches:
    """`n // batch_size` uint8 batches, written once each (a worker's batch is in shared
    memory): the hand-over alone, no reading. Map-style, one batch per index."""

    def __init__(self, n: int, batch_size: int, h: int, w: int):
        self.count = max(1, n // batch_size)
        self.shape = (batch_size, 3, h, w)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        if index >= self.count:
            raise IndexError(index)
        batch = new_uint8_batch(*self.shape)
        batch.fill_(1)
        return batch

    def thread_batches(self) -> bool:
        return True

    def read_batch(self, indices, rng):
        return self[indices[0]]  # ThreadLoader(batch_size=1): one prepared batch per index


def cost_breakdown(eval_ds, train_ds, batch_size: int, images: int = 400) -> str:
    """Per-image costs of the warm path in microseconds, one thread (torch too): read (the eval
    view's `preadv`; a train crop's rows), the crop's resize into its batch row, the mirror of
    half the crops (resized apart, then mirrored into the row), and the
    hand-over of a finished batch (a DataLoader worker's shared-memory batch against a thread's
    future). A Markdown table."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = min(images, len(eval_ds))
        spent = per_image_seconds(eval_ds, train_ds, n)
        handover = handover_seconds(n, batch_size, eval_ds.resolution)
    finally:
        torch.set_num_threads(torch_threads)
    us = {key: 1e6 * value / n for key, value in spent.items()}
    lines = [
        "| per image, one thread | us |",
        "|---|---:|",
        f"| eval: read the eval view row (`preadv`) | {us['view']:,.0f} |",
        f"| train: read the crop's rows (`preadv`) | {us['rows']:,.0f} |",
        f"| train: resize the crop into the batch row (antialiased bilinear) | {us['resize']:,.0f} "
        "|",
        f"| train: mirror into the row (half the crops; averaged over all) | {us['copy']:,.0f} |",
    ]
    lines += [
        f"| hand-over of a batch of {batch_size}, per image: {name} | {1e6 * value:,.0f} |"
        for name, value in handover.items()
    ]
    return "\n".join(lines)


def per_image_seconds(eval_ds, train_ds, n: int) -> dict[str, float]:
    """Seconds spent over the first `n` images reading the eval view (`view`), a train crop's
    rows (`rows`), resizing the crop into its batch row (`resize`) and mirroring (`copy`)."""
    h, w = eval_ds.resolution
    view = eval_ds.eval_view
    cache = train_ds.cache
    out = np.empty((h, w, 3), np.uint8)
    batch = new_uint8_batch(1, 3, h, w)
    scratch = np.empty(cache.max_side * cache.max_side * 3, np.uint8)
    rng = np.random.default_rng(0)
    spent = dict.fromkeys(("view", "rows", "resize", "copy"), 0.0)
    for i in range(n):
        t0 = time.perf_counter()
        if view is not None:
            view.read_into(out, i)
        t1 = time.perf_counter()
        ih, iw = (int(v) for v in cache.shapes[i])
        top, left, bh, bw = random_resized_box(ih, iw, rng, train_ds.SCALE, train_ds.RATIO)
        t2 = time.perf_counter()
        rows = cache.read_rows(i, top, bh, scratch[: bh * iw * 3].reshape(bh, iw, 3))
        t3 = time.perf_counter()
        crop = rows[:, left : left + bw]
        if bw != iw:  # as ImageCache.read_crop
            crop = np.ascontiguousarray(crop)
        flip = i % 2 == 1  # half the crops are mirrored
        # into the row, as the thread path; a mirrored crop is resized apart first
        row = batch[0]
        if flip:
            row = None
        image = resize_uint8(crop, (h, w), out=row)
        t4 = time.perf_counter()
        if flip:
            _opencv().flip(image.permute(1, 2, 0).numpy(), 1, dst=batch[0].permute(1, 2, 0).numpy())
        t5 = time.perf_counter()
        for key, seconds in zip(spent, (t1 - t0, t3 - t2, t4 - t3, t5 - t4), strict=True):
            spent[key] += seconds
    return spent


def handover_seconds(n: int, batch_size: int, resolution: tuple[int, int]) -> dict[str, float]:
    """Seconds per image to hand a finished batch over, best of 3: from one DataLoader worker
    (a shared-memory batch) and from one thread (a `ThreadLoader` future)."""
    h, w = resolution
    handover = {}
    for name, loader in (
        (
            "DataLoader worker (1, shared-memory batch)",
            DataLoader(EmptyBatches(n, batch_size, h, w), batch_size=None, num_workers=1),
        ),
        (
            "thread (ThreadLoader future)",
            ThreadLoader(EmptyBatches(n, batch_size, h, w), batch_size=1, threads=1),
        ),
    ):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            count = sum(len(b) for b in loader)
            best = min(best, (time.perf_counter() - start) / count)
        handover[name] = best
    return handover
