"""ShardUtterances: the utterances of an audio `ShardSet` as a map-style dataset, for the
spectrogram cache.

Use when: audio lives in shards (`write_shards` samples with a "flac", "wav", ... field) and its
features should be computed once: `build_spectrogram_cache(ShardSet.open(url), cache_dir)` wraps
the set in this class; wrap it yourself to choose `sample_rate`, `mono` or the audio field.
Cost: per process, a shard is read whole (checked against its index, `read_checked`) when one of
its samples is first asked for, and held as encoded bytes until another shard is; then one
decode per item (`ShardAudio`). The build's workers each read the shards they touch: a local
shard again from the page cache, a remote one downloaded again (copy large remote sets first).
The cache key is the index's sha256s: no shard is read to decide a rebuild.
Adapt here: `_hold` (what a process keeps of a shard).
Trade-off: one item per sample, so the cache is ragged (utterances); `info["file"]` is the
sample's position in the set (its key is `info["key"]` here, not in the cache). Cut long
recordings into windows before writing the shards, or cache `ChunkedAudioDataset` windows.
Copy with: audio/shard_audio.py, common/caches/cache_folder.py, common/caches/packed_strings.py,
  common/remote/object_download.py, common/sampling/sharding.py,
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

import io
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.audio.shard_audio import ShardAudio, ShardAudioError
from recipes.common.caches.packed_strings import resolve_index
from recipes.common.shards.shard_content import content_hash, read_checked
from recipes.common.shards.shard_set import ShardSet


class _HeldShard(NamedTuple):
    """The one shard a worker holds decoded: its number and its samples."""

    shard: int
    samples: list[dict]


class ShardUtterances(Dataset):
    """`dataset[i] == (float32 [C, T] waveform, {"file": i, "start": 0.0, "frames": T, "key"})`
    for sample `i` of a shard set, in index order (C = 1 when `mono`; T at `sample_rate`).

    Args:
        shards: a `ShardSet` of audio samples.
        sample_rate: output rate; None keeps the samples' rate, which must agree (the first
            sample's header is read once, on first use).
        mono: average channels to one.
        field: the audio field; None takes the first of `ShardAudio.AUDIO_FIELDS` present.

    Raises:
        ShardAudioError: (on use) a sample without audio or that does not decode, or one at
            another rate with `sample_rate=None`, naming its key.
    """

    # what the spectrogram cache's settings record of a ChunkedAudioDataset: utterances, no windows
    chunk_seconds = hop_seconds = last_chunk = None

    def __init__(
        self,
        shards: ShardSet,
        *,
        sample_rate: int | None = None,
        mono: bool = True,
        field: str | None = None,
    ):
        if not isinstance(shards, ShardSet):
            raise TypeError(f"`shards` must be a ShardSet, but is {type(shards).__name__} instead.")
        self.shards = shards
        self.mono = mono
        self.field = field
        self._decode = ShardAudio(sample_rate=sample_rate, mono=mono, field=field)
        self._rate = sample_rate
        self.starts = np.concatenate(([0], np.cumsum(shards.lengths))).astype(np.int64)
        self._held: _HeldShard | None = None

    @property
    def sample_rate(self) -> int:
        """The output rate: `sample_rate`, else the first sample's (its header only)."""
        if self._rate is None:
            import soundfile as sf

            if not len(self):
                raise ShardAudioError(f"{self.shards.url} holds no samples.")
            sample = self._sample(0)
            field = self.field or next((f for f in ShardAudio.AUDIO_FIELDS if f in sample), None)
            try:
                self._rate = int(sf.info(io.BytesIO(bytes(sample[field]))).samplerate)
            except (KeyError, TypeError, RuntimeError, sf.LibsndfileError):
                self._decode(sample)  # raises the typed error, naming the key
                raise
        return self._rate

    def content_hash(self) -> str:
        """The set's content (its index's sha256s) and the audio field: the cache's data key."""
        return content_hash(self.shards, "audio", self.field or "")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        i = resolve_index(index, len(self), f"the {len(self)} samples of {self.shards.url}")
        wave, info = self._decode(self._sample(i))
        if info["sample_rate"] != self.sample_rate:
            raise ShardAudioError(
                f"sample {info['key']!r} is at {info['sample_rate']} Hz, the first at "
                f"{self.sample_rate} Hz; pass ShardUtterances(shards, sample_rate=...) to "
                "resample them all."
            )
        return wave, {"file": i, "start": 0.0, "frames": int(wave.shape[-1]), "key": info["key"]}

    def _sample(self, i: int) -> dict:
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        if self._held is None or self._held.shard != shard:
            self._held = None  # drop the last shard before reading the next
            self._held = _HeldShard(shard, self._hold(shard))
        return self._held.samples[i - int(self.starts[shard])]

    def _hold(self, shard: int) -> list[dict]:
        return list(read_checked(self.shards, shard))

    def __getstate__(self):
        return {**self.__dict__, "_held": None}

    def __repr__(self) -> str:
        return f"ShardUtterances({self.shards.url!r}, {len(self)} samples, mono={self.mono})"
