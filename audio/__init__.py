"""Audio recipes: chunked reading of long files, precomputed spectrogram caches, padded batches."""

from recipes.audio.chunked import AudioDecodeError, ChunkedAudioDataset
from recipes.audio.collate import AudioPadCollate, pad_collate
from recipes.audio.shard_audio import ShardAudio, ShardAudioError
from recipes.audio.shard_utterances import ShardUtterances
from recipes.audio.spectrogram_cache import (
    SpectrogramCache,
    SpectrogramCacheError,
    build_spectrogram_cache,
)
from recipes.common.sampling.bucketing import LengthBucketSampler

__all__ = [
    "AudioDecodeError",
    "AudioPadCollate",
    "ChunkedAudioDataset",
    "LengthBucketSampler",
    "ShardAudio",
    "ShardAudioError",
    "ShardUtterances",
    "SpectrogramCache",
    "SpectrogramCacheError",
    "build_spectrogram_cache",
    "pad_collate",
]
