"""What a spectrogram cache is computed from: the featurizer, its settings and the fingerprint
of its inputs.

Use when: changing how features are computed (`featurizer`) or what invalidates a built cache
(`feature_settings`, `cache_fingerprint`): a cache whose fingerprint differs is rebuilt.
Cost: one `os.stat` per source file for the fingerprint (a shard set's index hash instead: no
shard is read); torchaudio is imported when a featurizer or the settings are made.
Adapt here: the featurizer (another transform keeps the cache format); add a setting to
`feature_settings` when it changes the features, so old caches are rebuilt.
Trade-off: file size and mtime stand for content (no hashing of audio); a file rewritten with
the same size within the same mtime tick is not detected.
Copy with: audio/shard_audio.py, audio/shard_utterances.py, common/caches/cache_folder.py,
  common/caches/packed_strings.py, common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_content.py, common/shards/shard_formats.py, common/shards/shard_index.py,
  common/shards/shard_samples.py, common/shards/shard_set.py, common/shards/sharded_dataset.py,
  common/shards/tar_members.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from recipes.audio.shard_utterances import ShardUtterances

FORMAT = "recipes-spectrogram-cache"
FORMAT_VERSION = 2  # 2: per-item checksums, a header checksum


def featurizer(sample_rate: int, *, n_fft: int, hop_length: int, n_mels: int, log: bool):
    """`wave [C, T] -> float32 [n_mels, F]`: torchaudio's MelSpectrogram of the channel mean,
    then `log(mel + 1e-6)` when `log`."""
    import torchaudio

    mel = torchaudio.transforms.MelSpectrogram(
        sample_rate=sample_rate, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels
    )

    def features(wave: torch.Tensor) -> torch.Tensor:
        spec = mel(wave.mean(dim=0))
        if log:
            return torch.log(spec + 1e-6)
        return spec

    return features


def cache_fingerprint(dataset, settings: dict) -> str:
    digest = hashlib.sha256(
        json.dumps(
            {"format": FORMAT, "version": FORMAT_VERSION, **settings}, sort_keys=True
        ).encode()
    )
    if isinstance(dataset, ShardUtterances):  # the shards' index: no shard is read
        digest.update(f"\nshards\0{dataset.content_hash()}".encode())
        return digest.hexdigest()
    for path in dataset.files:
        st = os.stat(path)
        digest.update(
            f"\n{path}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogateescape")
        )
    return digest.hexdigest()


def feature_settings(dataset, n_fft, hop_length, n_mels, log, dtype) -> dict:
    import torchaudio

    return {
        "chunk_seconds": dataset.chunk_seconds,
        "hop_seconds": dataset.hop_seconds,
        "last_chunk": dataset.last_chunk,
        "sample_rate": dataset.sample_rate,
        "mono": dataset.mono,
        "n_fft": n_fft,
        "hop_length": hop_length,
        "n_mels": n_mels,
        "log": log,
        "dtype": dtype,
        "torchaudio": torchaudio.__version__,
    }
