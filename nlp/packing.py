"""Sequence packing: documents packed whole into fixed `[B, T]` batches, with their boundaries.

Use when: training a causal (or masked) LM on variable-length documents and padding or
changing batch shapes costs you: packing fills 98-99% of every `[B, T]` batch with real
tokens and gives one batch shape for the whole run (no recompiles under `torch.compile` or
CUDA graphs). The attention must respect the document boundaries, or tokens attend across
unrelated texts: use `document_attention_mask` with SDPA, `document_block_mask` with
FlexAttention, or `cu_seqlens` with a varlen kernel (`flash_attn_varlen_func`). A model whose
attention cannot take one of these should use `LengthBucketSampler` + `PadCollate` instead.
Cost: one best-fit-decreasing pass over the epoch's documents in the main process when an
epoch starts (about 1 s per million documents); per batch, one gather from the token cache's
memory map and a few vectorised copies into one shared buffer.
Adapt here: `window` (how many rows' worth of documents are packed together: larger packs
denser, smaller keeps more of the shuffle), `split_long`, `max_docs_per_row`.
Trade-off: a document longer than T is cut into T-sized pieces, and a piece never sees the
piece before it (`split_long=False` refuses such documents instead). Rows are random across
epochs, but the documents of a row are those of one shuffled window.

Layout of a batch (`PackCollate`), all in one shared buffer (one segment per batch from a
worker):
  input_ids     int64 [B, T]   documents back to back in each row, then `pad_id`
  labels        int64 [B, T]   input_ids, -100 on each document's first token and on padding
                               (HF convention: the model shifts labels; no cross-document target)
  position_ids  int64 [B, T]   0, 1, ... restarting at every document (and over the padding)
  seq_lens      int32 [B, D]   each row's document lengths, then zeros (D = max_docs_per_row)
  cu_seqlens    int32 [B * (D + 1) + 1]  cumulative lengths over the flattened `[B * T]`
                               tokens, each row's padding as one more (maybe empty) segment
  num_tokens    int64 [1]      real tokens in the batch

Distributed and resume, as `LengthBucketSampler`: the epoch's batches are formed once from
`(seed, epoch)`, identically on every rank, and dealt round-robin; ranks get equal counts
(`drop_last=False` repeats at most R - 1 batches of the epoch); `state_dict()` saves the
global position, and `load_state_dict()` continues it on any number of ranks.
Copy with: common/caches/cache_files.py, common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated_loader.py, common/loading/loader.py,
  common/loading/loader_path.py, common/loading/loop_probe.py, common/loading/stateful_loader.py,
  common/loading/thread_loader.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_state.py, common/resume/order_sources.py,
  common/resume/pass_sampler.py, common/resume/state_keys.py, common/resume/state_records.py,
  common/sampling/bucketing.py, common/sampling/elastic_sampler.py, common/sampling/sharding.py,
  common/sizing/profiles.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/sizing/tune_store.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py,
  nlp/collate.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.sampling.bucketing import LengthBucketSampler
from recipes.nlp.collate import _new_int64  # one shared-memory buffer per batch in a worker

IGNORE_INDEX = -100


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

    Raises:
        ValueError: invalid sizes, or a document longer than `seq_len` with `split_long=False`.

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
    ):
        super().__init__(
            lengths,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
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
        self.empty_documents = len(empty)  # nothing to train on: never yielded

    @property
    def num_pieces(self) -> int:
        return len(self.piece_len)

    def global_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """Every batch of `epoch` (default: the current one) as arrays of keys, in dealing order."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rows = self.rows(epoch)
        p = self.num_pieces
        b = self.batch_size
        batches = []
        for first in range(0, len(rows), b):
            group = rows[first : first + b]
            batches.append(np.concatenate([row + r * p for r, row in enumerate(group)]))
        self._cache = (epoch, batches)
        return batches

    def rows(self, epoch: int) -> list[np.ndarray]:
        """The epoch's rows (arrays of piece ids), shuffled, before they are grouped in batches."""
        if not self.num_pieces:
            return []
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = (
            torch.randperm(self.num_pieces, generator=g).numpy()
            if self.shuffle
            else np.arange(self.num_pieces)
        )
        tokens = np.cumsum(self.piece_len[order])
        cuts = np.searchsorted(
            tokens,
            np.arange(1, tokens[-1] // (self.window * self.seq_len) + 1)
            * self.window
            * self.seq_len,
            side="right",
        )
        rows: list[np.ndarray] = []
        for chunk in np.split(order, cuts):
            if len(chunk):
                rows.extend(
                    _best_fit_decreasing(chunk, self.piece_len, self.seq_len, self.max_docs_per_row)
                )
        if self.shuffle and rows:
            rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        return rows

    def plan_settings(self) -> dict:
        """Every setting that shapes the epoch's rows and batches (checked on resume)."""
        return {
            **super().plan_settings(),
            "seq_len": self.seq_len,
            "window": self.window,
            "split_long": self.split_long,
            "max_docs_per_row": self.max_docs_per_row,
        }


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
        shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        flat = self.cache._map()[shift + np.arange(int(lengths.sum()))].astype(np.int64)
        parts = torch.from_numpy(flat).split(lengths.tolist())
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
        rank = np.arange(len(rows)) - np.repeat(
            np.cumsum(docs) - docs, docs
        )  # item's place in its row

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


def document_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """bool `[B, 1, T, T]`, True where a query may attend a key: causal, and only within its
    document (documents start where `position_ids` is 0). For SDPA's `attn_mask`."""
    if position_ids.dim() != 2:
        raise ValueError(
            f"`position_ids` must be [B, T], but has shape {tuple(position_ids.shape)}."
        )
    doc = (position_ids == 0).cumsum(dim=1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_block_mask(position_ids: torch.Tensor):
    """The same mask as a FlexAttention `BlockMask` (`torch.nn.attention.flex_attention`),
    which skips the blocks no query of a document needs: for `flex_attention(q, k, v,
    block_mask=...)`.

    Raises:
        RuntimeError: this torch has no FlexAttention.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        raise RuntimeError(
            "FlexAttention needs torch >= 2.5; use document_attention_mask with SDPA."
        ) from None
    doc = (position_ids == 0).cumsum(dim=1)
    b, t = position_ids.shape

    def same_document_causal(batch, head, q, kv):
        return (doc[batch, q] == doc[batch, kv]) & (kv <= q)

    return create_block_mask(same_document_causal, b, None, t, t, device=position_ids.device)


def packed_loader(
    cache,
    *,
    seq_len: int,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_replicas: int | None = None,
    rank: int | None = None,
    split_long: bool = True,
    drop_last: bool = False,
    pad_id: int = 0,
    window: int = 256,
    max_docs_per_row: int | None = None,
    **make_loader_overrides,
):
    """A DataLoader of packed `[batch_size, seq_len]` batches (this module's layout) over a
    `TokenCache`, through `make_loader` (the `text` profile: no pinned memory).

    Its `batch_sampler` is the `PackedBatchSampler` (`set_epoch`, `state_dict`,
    `load_state_dict`); the loader's own `state_dict()` counts the batches the loop received.

    Example:
        >>> loader = packed_loader(TokenCache.open("/cache/corpus"), seq_len=2048, batch_size=8)
        >>> for epoch in range(3):
        ...     loader.batch_sampler.set_epoch(epoch)
        ...     for batch in loader:
        ...         mask = document_attention_mask(batch["position_ids"])
    """
    from recipes.common.loading.loader import make_loader

    sampler = PackedBatchSampler(
        cache.lengths,
        seq_len=seq_len,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        window=window,
        num_replicas=num_replicas,
        rank=rank,
        split_long=split_long,
        drop_last=drop_last,
        max_docs_per_row=max_docs_per_row,
    )
    collate = PackCollate(
        seq_len, batch_size, pad_id=pad_id, max_docs_per_row=sampler.max_docs_per_row
    )
    return make_loader(
        PackedTokens(cache, sampler),
        batch_sampler=sampler,
        collate_fn=collate,
        **make_loader_overrides,
    )
