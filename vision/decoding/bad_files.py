"""BadFiles: a dataset's `on_error` policy for files that fail to decode, shared across workers.

Use when: a dataset of files should raise on a bad one (`on_error="raise"`) or replace it by the
next good one (`"skip"`), deterministically, and count what it skipped across worker processes.
Cost: one uint8 per file in shared memory; nothing per good item; a bad file costs its failed
attempt and a rewind of the generator's state.
Adapt here: `load`'s rewind (what a replacement draws) and its search (the next index, wrapping).
Trade-off: the replacement repeats a good image within the epoch; the count is of distinct files.
Copy with: vision/decoding/image_header.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np
import torch

from recipes.vision.decoding.image_header import ImageDecodeError


class BadFiles:
    """Which of `n` files failed to decode (in shared memory: marks reach the main process and
    persistent workers), and what to do about one: `on_error`.

    Args:
        n: the number of files.
        where: the files in words, for the error when every one fails ("the 12 images under /data").
    """

    def __init__(self, n: int, where: str):
        self.where = where
        self.marks = torch.zeros(n, dtype=torch.uint8).share_memory_()

    def load(
        self,
        index: int,
        load: Callable[[int], tuple],
        rng: np.random.Generator,
        *,
        on_error: Literal["raise", "skip"],
        rewind: bool,
    ) -> tuple:
        """`(*load(index), False)`; for a bad file, on_error="raise" raises its `ImageDecodeError`,
        "skip" gives `(*load(j), True)` for the next good index `j` after it (wrapping around),
        each bad one marked.

        A bad file consumes no randomness when `rewind` (a train dataset's crops and flips): `rng`
        is rewound to before its attempt, so the replacement draws what the bad file would have
        drawn. The CPU path finds a truncated or undecodable file only after drawing its crop (the
        decode needs the box), decode="gpu" workers before drawing (they check the bytes first);
        rewound, both give every later image the same crop and flip.

        Raises:
            ImageDecodeError: a bad file with on_error="raise", or every file bad.
        """
        n = len(self.marks)
        state = rng.bit_generator.state if rewind and on_error == "skip" else None
        for step in range(n):
            i = (index + step) % n
            try:
                return (*load(i), step > 0)
            except ImageDecodeError:
                if on_error == "raise":
                    raise
                self.marks[i] = 1
                if state is not None:
                    rng.bit_generator.state = state
        raise ImageDecodeError(f"every one of {self.where} failed to decode")

    def mark(self, indices: Iterable[int]) -> None:
        """Marks files found bad elsewhere (a cache build's skipped indices)."""
        for i in indices:
            self.marks[i] = 1

    @property
    def count(self) -> int:
        """Distinct bad files marked so far, across worker processes."""
        return int(self.marks.sum())

    def indices(self) -> np.ndarray:
        return np.flatnonzero(self.marks.numpy())
