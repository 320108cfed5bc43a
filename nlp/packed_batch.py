"""The packed batch: a pack plan's pieces read from a token cache and laid out in `[B, T]`.

Use when: packing documents into fixed `[B, T]` batches (`packing.py`): `PackedTokens` reads
the pieces a `PackedBatchSampler` planned, in one gather per batch; `PackCollate` lays them
out, with their boundaries, in one shared buffer (one segment per batch from a worker).
Cost: per batch, one gather from the token cache's memory map and a few vectorised copies.
Adapt here: `PackCollate` (the layout: another label convention, more per-document fields).
Trade-off: every batch has the same shape, its last rows maybe all padding; padding is one more
"document" per row, so every query attends to something.

Layout of a batch (`PackCollate`), all in one shared buffer:
  input_ids     int64 [B, T]   documents back to back in each row, then `pad_id`
  labels        int64 [B, T]   input_ids, -100 on each document's first token and on padding
                               (HF convention: the model shifts labels; no cross-document target)
  position_ids  int64 [B, T]   0, 1, ... restarting at every document (and over the padding)
  seq_lens      int32 [B, D]   each row's document lengths, then zeros (D = max_docs_per_row)
  cu_seqlens    int32 [B * (D + 1) + 1]  cumulative lengths over the flattened `[B * T]`
                               tokens, each row's padding as one more (maybe empty) segment
  num_tokens    int64 [1]      real tokens in the batch
Copy with: common/loader_warning.py, common/sampling/bucketing.py, common/sampling/sharding.py,
  nlp/collate.py, nlp/pack_plan.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.nlp.collate import _new_int64  # one shared-memory buffer per batch in a worker
from recipes.nlp.pack_plan import PackedBatchSampler

IGNORE_INDEX = -100


class PackedTokens(Dataset):
    """A `TokenCache` seen through a `PackedBatchSampler`'s pieces: `dataset[key]` is
    `{"input_ids": LongTensor[L], "row": r}` for the key `r * num_pieces + piece`.

    Pickles as the cache (its path) and the piece table (numpy); `__getitems__` gathers a
    whole batch from the memory map at once.
    """

    recommended_profile = "text"  # make_loader: no pinned memory for small int batches

    def __init__(self, cache, sampler: PackedBatchSampler):
        if len(sampler.lengths) != len(cache) or not np.array_equal(
            sampler.lengths, np.asarray(cache.lengths)
        ):
            raise ValueError(
                "PackedTokens: the sampler was built from other lengths than this cache's "
                "(pass cache.lengths to PackedBatchSampler)."
            )
        self.cache = cache
        self.piece_doc = sampler.piece_doc
        self.piece_start = sampler.piece_start
        self.piece_len = sampler.piece_len
        self.offsets = np.asarray(cache.offsets)

    def __len__(self) -> int:
        return len(self.piece_len)

    def __getitem__(self, key: int) -> dict:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int]) -> list[dict]:
        keys = np.asarray(keys, dtype=np.int64)
        p = len(self.piece_len)
        if keys.size and keys.min() < 0:
            raise IndexError(
                f"PackedTokens: negative key {int(keys.min())}; use the PackedBatchSampler's "
                "batches (keys are row * num_pieces + piece)."
            )
        rows, pieces = np.divmod(keys, p)
        starts = self.offsets[self.piece_doc[pieces]] + self.piece_start[pieces]
        lengths = self.piece_len[pieces]
        parts = self.cache.read_spans(starts, lengths)
        return [
            {"input_ids": ids, "row": int(r)} for ids, r in zip(parts, rows.tolist(), strict=True)
        ]


class PackCollate:
    """Packs `PackedTokens` items (grouped by `row`, in row order) into the static-shape batch
    described in this module's docstring.

    Args:
        seq_len: T.
        batch_size: B (rows; rows without items are all padding).
        pad_id: the id on padding.
        max_docs_per_row: D, the width of `seq_lens` (default T: always enough).

    Raises:
        ValueError: a row over T tokens or D documents, or a row index over B.
    """

    def __init__(
        self, seq_len: int, batch_size: int, *, pad_id: int = 0, max_docs_per_row: int | None = None
    ):
        for name, value in (
            ("seq_len", seq_len),
            ("batch_size", batch_size),
            ("max_docs_per_row", max_docs_per_row),
        ):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be a positive int, but is {value!r} instead.")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.pad_id = int(pad_id)
        self.max_docs = max_docs_per_row or seq_len

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        b = self.batch_size
        t = self.seq_len
        d = self.max_docs
        rows = np.fromiter((item["row"] for item in items), np.int64, len(items))
        lengths = np.fromiter((len(item["input_ids"]) for item in items), np.int64, len(items))
        if len(rows) and (np.diff(rows) < 0).any():
            raise ValueError(
                "PackCollate: items must come grouped by row, in row order (PackedBatchSampler's "
                "order)."
            )
        if len(rows) and rows[-1] >= b:
            raise ValueError(
                f"PackCollate: row {int(rows[-1])} in a batch of {b} rows; batch_size must match "
                "the sampler's."
            )
        used = np.bincount(rows, weights=lengths, minlength=b).astype(np.int64)
        docs = np.bincount(rows, minlength=b)
        if (used > t).any() or (docs > d).any():
            row = int(np.flatnonzero((used > t) | (docs > d))[0])
            raise ValueError(
                f"PackCollate: row {row} holds {int(used[row])} tokens in {int(docs[row])} "
                f"documents, over seq_len={t} or max_docs_per_row={d}; use the sampler's seq_len "
                "and max_docs_per_row."
            )
        # where each item starts: its row, plus the tokens of the items before it in that row
        ends_in_row = np.cumsum(lengths) - np.repeat(np.cumsum(used) - used, docs)
        starts = rows * t + ends_in_row - lengths
        # each item's place in its row
        rank = np.arange(len(rows)) - np.repeat(np.cumsum(docs) - docs, docs)

        n_int32 = b * d + b * (d + 1) + 1
        buffer = _new_int64(3 * b * t + (n_int32 + 1) // 2 + 1)
        input_ids = buffer[: b * t].view(b, t)
        labels = buffer[b * t : 2 * b * t].view(b, t)
        position_ids = buffer[2 * b * t : 3 * b * t].view(b, t)
        small = buffer[3 * b * t : -1].view(torch.int32)
        seq_lens = small[: b * d].view(b, d)
        cu_seqlens = small[b * d : n_int32]
        num_tokens = buffer[-1:]

        flat_ids = input_ids.view(-1)
        flat_pos = position_ids.view(-1)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        dest = torch.from_numpy(np.repeat(starts, lengths) + within)
        input_ids.fill_(self.pad_id)
        if len(items):
            flat_ids[dest] = torch.cat([item["input_ids"] for item in items])
        # padding: one more "document" per row, positions 0, 1, ... (keeps every query attending to
        # something)
        columns = torch.arange(t)
        position_ids.copy_(columns - torch.from_numpy(used)[:, None])
        flat_pos[dest] = torch.from_numpy(within)
        labels.copy_(input_ids)
        labels.view(-1)[torch.from_numpy(starts)] = IGNORE_INDEX
        labels.masked_fill_(columns >= torch.from_numpy(used)[:, None], IGNORE_INDEX)

        table = np.zeros((b, d + 1), np.int64)
        table[rows, rank] = lengths
        seq_lens.copy_(torch.from_numpy(table[:, :d]))
        table[:, d] = t - used  # the row's padding, so every row ends at a multiple of T
        cu_seqlens[0] = 0
        cu_seqlens[1:].copy_(torch.from_numpy(np.cumsum(table.reshape(-1))))
        num_tokens[0] = int(used.sum())
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "seq_lens": seq_lens,
            "cu_seqlens": cu_seqlens,
            "num_tokens": num_tokens,
        }
