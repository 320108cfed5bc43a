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

The batch's layout is described in `packed_batch.py`; the plan is `pack_plan.py`'s.

Distributed and resume, as `LengthBucketSampler`: the epoch's batches are formed once from
`(seed, epoch)`, identically on every rank, and dealt round-robin; ranks get equal counts
(`drop_last=False` repeats at most R - 1 batches of the epoch); `state_dict()` saves the
global position, and `load_state_dict()` continues it on any number of ranks.
Copy with: common/caches/cache_files.py, common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated/child.py,
  common/loading/isolated/protocol.py, common/loading/isolated_loader.py, common/loading/loader.py,
  common/loading/loader_path.py, common/loading/loader_rules.py, common/loading/loop_probe.py,
  common/loading/stateful_loader.py, common/loading/thread_loader.py,
  common/loading/worker_rules.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sampling/bucketing.py, common/sampling/elastic_sampler.py,
  common/sampling/sharding.py, common/sizing/profiles.py, common/sizing/resources.py,
  common/sizing/sizing.py, common/sizing/tune_store.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py,
  nlp/collate.py, nlp/pack_plan.py, nlp/packed_batch.py.
"""

from __future__ import annotations

import torch

from recipes.common.loading.loader import make_loader
from recipes.nlp.pack_plan import PackedBatchSampler
from recipes.nlp.packed_batch import PackCollate, PackedTokens


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
