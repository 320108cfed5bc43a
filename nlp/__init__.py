"""NLP recipes: cached tokenization, length-bucketed / token-budget batching, dynamic padding,
sequence packing, and text tokenized and packed on the fly (`streaming/`)."""

from recipes.common.sampling.bucketing import LengthBucketSampler
from recipes.nlp.collate import PadCollate
from recipes.nlp.pack_plan import PackedBatchSampler
from recipes.nlp.packed_batch import PackCollate, PackedTokens
from recipes.nlp.packing import document_attention_mask, document_block_mask, packed_loader
from recipes.nlp.streaming.packed_text_stream import (
    PackedRowCollate,
    PackedTextStream,
    packed_text_loader,
)
from recipes.nlp.token_cache import TokenCache, TokenCacheError, build_token_cache

__all__ = [
    "LengthBucketSampler",
    "PackCollate",
    "PackedBatchSampler",
    "PackedRowCollate",
    "PackedTextStream",
    "PackedTokens",
    "PadCollate",
    "TokenCache",
    "TokenCacheError",
    "build_token_cache",
    "document_attention_mask",
    "document_block_mask",
    "packed_loader",
    "packed_text_loader",
]
