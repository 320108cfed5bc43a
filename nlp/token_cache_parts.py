"""A token cache's build in parts: each rank tokenizes its batches, one process joins them.

Use when: `build_token_cache` writes a cache, alone (one part) or over the ranks of a process
group (batch k to rank `k % world`): each rank writes its part's tokens and lengths, and the
folder's leader joins the parts in source order into `tokens.bin` and `offsets.bin`.
Cost: one write of every token by its rank, one copy of every token by the leader (16 MiB
blocks), and an fsync of each file.
Adapt here: `write_part` (what is written per batch).
Trade-off: the join copies the tokens once more instead of writing them in place, so that every
folder ends byte-identical to a single-process build whatever the number of ranks.
Copy with: common/caches/build_ranks.py, common/caches/cache_builds.py,
  common/caches/cache_files.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from recipes.common.caches.cache_builds import FolderBuild


class PartTotals(NamedTuple):
    """What a rank's part holds (gathered over the ranks, then summed)."""

    count: int
    """Samples."""
    num_tokens: int
    """Their tokens."""


def write_part(
    batches: Iterable[list[str]],
    encode: Callable[[list[str]], list[list[int]]],
    build: FolderBuild,
    dtype: np.dtype,
    bar,
) -> None:
    """This rank's `batches` (`k % world == rank`): tokens and per-sample lengths, in order."""
    with (
        open(build.part("tokens.bin"), "wb") as tokens_file,
        open(build.part("lengths.bin"), "wb") as lengths_file,
    ):
        for batch in batches:
            ids = encode(batch)
            lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
            tokens_file.write(
                np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum())).tobytes()
            )
            lengths_file.write(lengths.astype("<i8").tobytes())
            bar.update(len(batch) * build.world)
        for f in (tokens_file, lengths_file):
            f.flush()
            os.fsync(f.fileno())


def part_totals(build: FolderBuild) -> PartTotals:
    """What this rank's part holds."""
    lengths = np.fromfile(build.part("lengths.bin"), "<i8")
    return PartTotals(len(lengths), int(lengths.sum()))


def join_parts(build: FolderBuild, batch_size: int, dtype: np.dtype) -> None:
    """The leader: the parts' batches back in source order (k = 0, 1, ...: rank k % world) into
    `tokens.bin` and `offsets.bin`, as one process would have written them."""
    lengths = [np.fromfile(build.part("lengths.bin", r), "<i8") for r in range(build.world)]
    parts = [open(build.part("tokens.bin", r), "rb") for r in range(build.world)]  # noqa: SIM115
    order = []
    try:
        with open(build.path / "tokens.bin", "wb") as out:
            for k in itertools.count():
                rank = k % build.world
                j = k // build.world
                seg = lengths[rank][j * batch_size : (j + 1) * batch_size]
                if not len(seg):
                    break
                shutil.copyfileobj(
                    _Limited(parts[rank], int(seg.sum()) * dtype.itemsize), out, 1 << 24
                )
                order.append(seg)
            out.flush()
            os.fsync(out.fileno())
    finally:
        for f in parts:
            f.close()
    all_lengths = np.concatenate([np.zeros(1, np.int64), *order])
    with open(build.path / "offsets.bin", "wb") as f:
        f.write(np.cumsum(all_lengths).astype("<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())
    for r in range(build.world):
        build.part("tokens.bin", r).unlink()
        build.part("lengths.bin", r).unlink()


class _Limited:
    """The next `size` bytes of a file object, for `shutil.copyfileobj`."""

    def __init__(self, f, size: int):
        self.f = f
        self.left = size

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.left
        data = self.f.read(min(n, self.left))
        self.left -= len(data)
        return data
