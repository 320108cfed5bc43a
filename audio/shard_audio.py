"""Audio from shard samples (WebDataset tar or Parquet): utterances as `ChunkedAudioDataset` reads
them.

Use when: a `ShardSet` (`recipes.common.shards.shard_set`) holds encoded audio (`"flac"`, `"wav"` or
other such fields): `ShardSet.dataset(transform=ShardAudio(sample_rate=16000))` yields `(float32 [C,
T], info)` per sample, decoded by libsndfile (`soundfile`), averaged to mono and resampled as
`ChunkedAudioDataset` does in utterance mode; `info` holds the key and the other fields.
Cost: one decode of the whole utterance per sample (shard samples are utterances).
Adapt here: `AUDIO_FIELDS`.
Trade-off: one output per sample, so that the shard reader's exact counts hold; cut long
recordings into windows before writing the shards (`ChunkedAudioDataset` over the files).
Copy with: nothing.
"""

from __future__ import annotations

import io

import torch


class ShardAudioError(ValueError):
    """A sample without audio, or audio libsndfile cannot decode (naming the key)."""


class ShardAudio:
    """`sample -> (float32 [C, T], info)`: decoded, mono when asked, at `sample_rate`.

    Args:
        sample_rate: output rate; None keeps each sample's.
        mono: average channels to one.
        field: the audio field; None takes the first of `AUDIO_FIELDS` present.
    """

    AUDIO_FIELDS = ("flac", "wav", "ogg", "mp3")

    def __init__(
        self, *, sample_rate: int | None = None, mono: bool = True, field: str | None = None
    ):
        if sample_rate is not None and sample_rate <= 0:
            raise ValueError(f"`sample_rate` must be positive, but is {sample_rate!r} instead.")
        self.sample_rate = sample_rate
        self.mono = mono
        self.field = field
        self._resamplers: dict = {}

    def __call__(self, sample: dict):
        import soundfile as sf

        key = sample.get("__key__", "<no key>")
        field = self.field or next((f for f in self.AUDIO_FIELDS if f in sample), None)
        if field is None or field not in sample:
            raise ShardAudioError(
                f"sample {key!r} has no audio field {field or list(self.AUDIO_FIELDS)} (its "
                f"fields: {sorted(k for k in sample if k != '__key__')}); pass field=."
            )
        try:
            data, rate = sf.read(io.BytesIO(bytes(sample[field])), dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, TypeError) as error:
            raise ShardAudioError(
                f"sample {key!r}: its {field!r} does not decode as audio ({error}); re-encode "
                "it, or filter the sample out before writing the shards."
            ) from None
        if data.shape[0] == 0:
            raise ShardAudioError(f"sample {key!r}: its {field!r} holds no audio frames.")
        wave = torch.from_numpy(data.T.copy())
        if self.mono:
            wave = wave.mean(dim=0, keepdim=True)
        target = self.sample_rate or rate
        if rate != target:
            if rate not in self._resamplers:
                import torchaudio

                self._resamplers[rate] = torchaudio.transforms.Resample(rate, target)
            wave = self._resamplers[rate](wave)
        info = {
            "key": key,
            "sample_rate": target,
            "frames": wave.shape[-1],
            **{k: v for k, v in sample.items() if k not in (field, "__key__")},
        }
        return wave, info

    def __getstate__(self):
        return {**self.__dict__, "_resamplers": {}}
