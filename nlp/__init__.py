"""NLP recipes: cached tokenization, length-bucketed / token-budget batching, dynamic padding,
sequence packing."""

from recipes.common.sampling.bucketing import LengthBucketSampler
from recipes.nlp.collate import PadCollate
from recipes.nlp.pack_plan import PackedBatchSampler
from recipes.nlp.packed_batch import PackCollate, PackedTokens
from recipes.nlp.packing import document_attention_mask, document_block_mask, packed_loader
from recipes.nlp.token_cache import TokenCache, TokenCacheError, build_token_cache

__all__ = [
    "LengthBucketSampler",
    "PackCollate",
    "PackedBatchSampler",
    "PackedTokens",
    "PadCollate",
    "TokenCache",
    "TokenCacheError",
    "build_token_cache",
    "document_attention_mask",
    "document_block_mask",
    "packed_loader",
]
