"""NLP recipes: cached tokenization, length-bucketed / token-budget batching, dynamic padding."""

from recipes.common.bucketing import LengthBucketSampler
from recipes.nlp.collate import PadCollate
from recipes.nlp.token_cache import TokenCache, TokenCacheError, build_token_cache

__all__ = [
    "LengthBucketSampler",
    "PadCollate",
    "TokenCache",
    "TokenCacheError",
    "build_token_cache",
]
