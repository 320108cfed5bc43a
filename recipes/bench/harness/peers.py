"""Peer libraries measured side by side in `recipes bench` (installed for benchmarks only, never
dependencies of the library): LitData's raw uint8 image path.

Use when: `recipes bench vision` prints a LitData row when `litdata` is importable
(`pip install litdata`); without it the row is left out and the table says so.
Cost: one `litdata.optimize` of the images (decoded once, stored raw) into a temp folder.
Adapt here: `SQUARE`, the side LitData stores (its ImageNet recipes store 256 px).
Trade-off: LitData's raw path stores a centre square (short side resized to `SQUARE`, the
square's centre cut): eval reads a centre `size` crop of it, a view, collated by the
DataLoader. That is LitData at its fastest; a train crop from it sees only the centre square.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SQUARE = 256


def litdata_available() -> bool:
    return importlib.util.find_spec("litdata") is not None


def _square(item):
    """`optimize`'s function: (path, label) to the raw uint8 centre square, as LitData stores it."""
    import cv2
    import numpy as np

    path, label = item
    image = cv2.cvtColor(cv2.imread(path, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    h, w = image.shape[:2]
    scale = SQUARE / min(h, w)
    image = cv2.resize(
        image,
        (max(SQUARE, round(w * scale)), max(SQUARE, round(h * scale))),
        interpolation=cv2.INTER_AREA,
    )
    h, w = image.shape[:2]
    top = (h - SQUARE) // 2
    left = (w - SQUARE) // 2
    return {
        "image": np.ascontiguousarray(image[top : top + SQUARE, left : left + SQUARE]),
        "label": int(label),
    }


def litdata_eval_loader(
    samples: list[tuple[str, int]], out_dir: Path, *, size: int, batch_size: int, workers: int
):
    """LitData's raw uint8 path over `samples`: `optimize` to `out_dir` (2 processes), then a
    `StreamingDataLoader` over a `StreamingDataset` yielding the centre `size` crop."""
    import litdata
    import torch

    litdata.optimize(
        fn=_square,
        inputs=list(samples),
        output_dir=str(out_dir),
        chunk_bytes="64MB",
        num_workers=2,
        verbose=False,
        start_method="fork",
    )
    offset = (SQUARE - size) // 2

    class Eval(litdata.StreamingDataset):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            image = torch.as_tensor(item["image"])[
                offset : offset + size, offset : offset + size
            ].permute(2, 0, 1)
            return image, item["label"]

    dataset = Eval(str(out_dir))
    return litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers)
