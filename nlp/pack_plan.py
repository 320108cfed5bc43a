"""PackedBatchSampler: the pack plan, documents packed whole into rows of `seq_len` tokens.

Use when: packing documents into fixed `[B, T]` batches (`packing.py`): this is the plan, the
rows of each batch as piece ids, drawn from `(seed, epoch)` identically on every rank and dealt
round-robin as `LengthBucketSampler` deals its batches.
Cost: one best-fit-decreasing pass over the epoch's pieces in the main process when an epoch
starts (about 1 s per million documents), cached for the epoch.
Adapt here: `window` (how many rows' worth of documents are packed together: larger packs
denser, smaller keeps more of the shuffle), `split_long`, `max_docs_per_row`.
Trade-off: a document longer than T is cut into T-sized pieces, and a piece never sees the
piece before it (`split_long=False` refuses such documents instead). Rows are random across
epochs, but the documents of a row are those of one shuffled window.

Mixture: with `mixture=` the documents come in the mixture's plan order (mix first, then pack).
A paced mixture (`mixture.paced`: a `Schedule`, or `lengths=` for shares of tokens) holds its
shares in every stretch of its plan, so its rows are shuffled only within their window of
`window` rows: the windows keep their plan order and each holds the shares the schedule gives
there. A window displaces its tokens by up to its size, so keep `window * seq_len` well under
the stretch over which the shares must hold: windows of 4 rows of 1024 hold every 64k-token
stretch within 1.2 points (tested, 2 points asserted), 8 rows within 2, 256 rows of 512 miss
by 7; small windows pack less densely (86% real tokens at 4 rows of 1024, 92% at 8).
Copy with: common/loader_warning.py, common/sampling/bucketing.py, common/sampling/sharding.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from recipes.common.sampling.bucketing import LengthBucketSampler, window_cuts


class _EpochBatches(NamedTuple):
    """The plan of one epoch, kept for the epoch's later calls."""

    epoch: int
    batches: list[np.ndarray]


class PackedBatchSampler(LengthBucketSampler):
    """Yields batches of `batch_size` rows of at most `seq_len` tokens, documents kept whole.

    A batch is a list of keys `row * num_pieces + piece` for `PackedTokens`; a piece is a
    whole document, or a `seq_len`-sized part of a longer one (`split_long`).

    Args:
        lengths: tokens per document, e.g. `TokenCache.lengths`.
        seq_len: T, tokens per row.
        batch_size: B, rows per batch (every batch has B rows; the epoch's last one may have
            empty rows, all padding).
        shuffle: shuffle documents, then rows, from `(seed, epoch)`.
        seed: the base seed, identical on every rank.
        window: rows' worth of documents packed together (best-fit decreasing within each
            shuffled window).
        num_replicas, rank: the `torch.distributed` world when initialised, else 1 and 0.
        split_long: cut a document longer than `seq_len` into `seq_len`-sized pieces; with
            False such a document raises ValueError (truncate at tokenization instead).
        drop_last: drop the last batches to equalise ranks, instead of repeating the first.
        max_docs_per_row: at most this many documents in a row (the width of `seq_lens`).
        mixture: a `MixtureSampler` (`num_replicas=1`, no `batch_size`, sizes summing to
            `len(lengths)`) whose epoch plan is packed instead of every document once: its
            documents' pieces in the plan's order (a document the plan repeats is packed
            again), packed window by window as above. A paced mixture's rows are shuffled
            within their window only, so its shares hold along the epoch (module docstring).

    Raises:
        ValueError: invalid sizes, a document longer than `seq_len` with `split_long=False`,
            or a mixture dealt over ranks, in batches, or of other sizes than `lengths`.

    Example:
        >>> sampler = PackedBatchSampler(cache.lengths, seq_len=2048, batch_size=8)
        >>> loader = make_loader(PackedTokens(cache, sampler), batch_sampler=sampler,
        ...                      collate_fn=PackCollate(2048, 8, pad_id=0))
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        window: int = 256,
        num_replicas: int | None = None,
        rank: int | None = None,
        split_long: bool = True,
        drop_last: bool = False,
        max_docs_per_row: int | None = None,
        mixture=None,
    ):
        super().__init__(
            lengths,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
            mixture=mixture,
        )
        for name, value in (
            ("seq_len", seq_len),
            ("window", window),
            ("max_docs_per_row", max_docs_per_row),
        ):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be a positive int, but is {value!r} instead.")
        self.seq_len = seq_len
        self.window = window
        self.split_long = split_long
        self.max_docs_per_row = max_docs_per_row or seq_len
        long = np.flatnonzero(self.lengths > seq_len)
        if len(long) and not split_long:
            raise ValueError(
                f"{len(long)} documents are longer than seq_len={seq_len} (document {int(long[0])} "
                f"has {int(self.lengths[long[0]])} tokens); pass split_long=True to cut them into "
                "seq_len-sized pieces, raise seq_len, or truncate at tokenization (max_length)."
            )
        empty = np.flatnonzero(self.lengths == 0)
        docs = np.flatnonzero(self.lengths > 0)
        # pieces: (document, first token, length); a document of L tokens gives ceil(L / T) pieces
        counts = -(-self.lengths[docs] // seq_len)
        self.piece_doc = np.repeat(docs, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        self.piece_start = (np.arange(len(self.piece_doc)) - first) * seq_len
        self.piece_len = np.minimum(self.lengths[self.piece_doc] - self.piece_start, seq_len)
        # every document's first piece and piece count (0 for an empty one), for a mixture's plan
        self.doc_pieces = np.zeros(len(self.lengths), dtype=np.int64)
        self.doc_pieces[docs] = counts
        self.doc_first = np.cumsum(self.doc_pieces) - self.doc_pieces
        self.empty_documents = len(empty)  # nothing to train on: never yielded

    @property
    def num_pieces(self) -> int:
        return len(self.piece_len)

    def global_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """Every batch of `epoch` (default: the current one) as arrays of keys, in dealing order."""
        if epoch is None:
            epoch = self.epoch
        if self._cache is not None and self._cache.epoch == epoch:
            return self._cache.batches
        rows = self.rows(epoch)
        p = self.num_pieces
        b = self.batch_size
        batches = []
        for first in range(0, len(rows), b):
            group = rows[first : first + b]
            batches.append(np.concatenate([row + r * p for r, row in enumerate(group)]))
        self._cache = _EpochBatches(epoch, batches)
        return batches

    def rows(self, epoch: int) -> list[np.ndarray]:
        """The epoch's rows (arrays of piece ids), shuffled, before they are grouped in batches."""
        if not self.num_pieces:
            return []
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        if self.mixture is not None:
            order = self.plan_pieces(self.mixture.global_indices(epoch))
        elif self.shuffle:
            order = torch.randperm(self.num_pieces, generator=g).numpy()
        else:
            order = np.arange(self.num_pieces)
        # a paced mixture's rows are shuffled within their window only: each window keeps the
        # shares the plan holds there
        local = self.mixture is not None and self.mixture.paced
        cuts = window_cuts(self.piece_len[order], self.window * self.seq_len)
        rows: list[np.ndarray] = []
        for chunk in np.split(order, cuts):
            if not len(chunk):
                continue
            packed = _best_fit_decreasing(
                chunk, self.piece_len, self.seq_len, self.max_docs_per_row
            )
            if self.shuffle and local:
                packed = [packed[i] for i in torch.randperm(len(packed), generator=g).tolist()]
            rows.extend(packed)
        if self.shuffle and rows and not local:
            rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        return rows

    def plan_pieces(self, documents: np.ndarray) -> np.ndarray:
        """The pieces of `documents` (a mixture's plan, repeats included), in their order: a
        document's pieces one after another, an empty document none."""
        counts = self.doc_pieces[documents]
        first = np.repeat(self.doc_first[documents], counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return first + within

    def plan_settings(self) -> dict:
        """Every setting that shapes the epoch's rows and batches (checked on resume)."""
        settings = {
            **super().plan_settings(),
            "seq_len": self.seq_len,
            "window": self.window,
            "split_long": self.split_long,
            "max_docs_per_row": self.max_docs_per_row,
        }
        settings.pop("mixture_window", None)  # packing's window is `window`
        return settings


def _best_fit_decreasing(
    pieces: np.ndarray, lengths: np.ndarray, capacity: int, max_docs: int
) -> list[np.ndarray]:
    """Rows of `pieces`: longest first, each into the fullest row it still fits (free space
    kept sorted, so each placement is a bisection)."""
    pieces = pieces[np.argsort(-lengths[pieces], kind="stable")]
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    rows: list[list[int]] = []
    for piece, length in zip(pieces.tolist(), lengths[pieces].tolist(), strict=True):
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space = capacity
            row = len(rows)
            rows.append([])
        rows[row].append(piece)
        if space - length > 0 and len(rows[row]) < max_docs:
            bisect.insort(free, (space - length, row))
    return [np.asarray(row, dtype=np.int64) for row in rows]
