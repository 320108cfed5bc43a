"""Audio shards feed the spectrogram cache (issue 27): a `ShardSet` or `ShardUtterances` into
`build_spectrogram_cache`, checked against the uncached path: the files decoded by
`ChunkedAudioDataset` (utterance mode) and featurised on the fly."""

from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.audio import ChunkedAudioDataset, ShardAudioError, build_spectrogram_cache
from recipes.audio.shard_utterances import ShardUtterances
from recipes.audio.spectrogram_cache import featurizer
from recipes.common.shards.shard_set import ShardFormatError, ShardSet
from recipes.common.shards.shard_writer import write_shards


def _samples(files):
    return [
        {"__key__": f"u{i}", "flac": Path(f).read_bytes(), "cls": i} for i, f in enumerate(files)
    ]


def _on_the_fly(ds, i, **kw):
    params = dict(n_fft=400, hop_length=160, n_mels=80, log=True) | kw
    return featurizer(ds.sample_rate, **params)(ds[i][0])


@pytest.mark.parametrize("format", ["tar", "parquet"])
def test_a_shard_set_caches_the_features_of_its_utterances(audio_files, tmp_path, format):
    if format == "parquet":
        pytest.importorskip("pyarrow")
    shards = write_shards(
        _samples(audio_files),
        tmp_path / "s",
        format=format,
        shard_bytes=1,
        progress=False,
        shuffle=False,
    )
    assert len(shards.entries) == 3  # one utterance per shard: items cross shards
    cache = build_spectrogram_cache(shards, tmp_path / "c", num_workers=2, progress=False)
    files = ChunkedAudioDataset(audio_files)  # the uncached path, from the original files
    assert cache.header["layout"] == "ragged" and cache.lengths.tolist() == [1001, 351, 71]
    for i in range(len(files)):
        features, info = cache[i]
        torch.testing.assert_close(features, _on_the_fly(files, i).half().float(), rtol=0, atol=0)
        assert info == {
            "file": i,
            "start": 0.0,
            "frames": min(features.shape[-1], 1 + int(files.item_frames[i]) // 160),
        }
    stamp = (tmp_path / "c" / "features.bin").stat().st_mtime_ns
    again = build_spectrogram_cache(
        ShardSet.open(tmp_path / "s"), tmp_path / "c", num_workers=0, progress=False
    )
    assert again.fingerprint == cache.fingerprint  # keyed on the index: reused
    assert (tmp_path / "c" / "features.bin").stat().st_mtime_ns == stamp


def test_shard_utterances_resample_and_equal_the_file_dataset(audio_files, tmp_path):
    shards = write_shards(_samples(audio_files), tmp_path / "s", progress=False, shuffle=False)
    utterances = ShardUtterances(shards, sample_rate=8000)
    files = ChunkedAudioDataset(audio_files, sample_rate=8000)
    for i in range(len(files)):
        wave, info = utterances[i]
        expected = files[i][0]
        assert info["key"] == f"u{i}" and wave.shape == expected.shape
        torch.testing.assert_close(wave, expected, rtol=0, atol=1e-5)
    cache = build_spectrogram_cache(
        utterances, tmp_path / "c", n_mels=40, dtype="float32", num_workers=0, progress=False
    )
    for i in range(len(files)):
        torch.testing.assert_close(
            cache[i][0], _on_the_fly(files, i, n_mels=40), rtol=1e-4, atol=1e-3
        )
    other = build_spectrogram_cache(
        ShardUtterances(shards),
        tmp_path / "c",
        n_mels=40,
        dtype="float32",
        num_workers=0,
        progress=False,
    )
    assert other.fingerprint != cache.fingerprint and other.header["sample_rate"] == 16000


def test_differing_rates_without_sample_rate_name_the_sample(audio_files, tmp_path):
    import soundfile as sf

    sf.write(tmp_path / "low.flac", np.zeros(8000, np.float32), 8000)
    samples = _samples(audio_files[:1]) + [
        {"__key__": "low", "flac": (tmp_path / "low.flac").read_bytes(), "cls": 9}
    ]
    shards = write_shards(samples, tmp_path / "s", progress=False, shuffle=False)
    with pytest.raises(
        ShardAudioError,
        match=r"sample 'low' is at 8000 Hz, the first at 16000 Hz; pass .*sample_rate=",
    ):
        build_spectrogram_cache(shards, tmp_path / "c", num_workers=0, progress=False)


def test_a_damaged_shard_is_refused_and_paths_get_a_hint(audio_files, tmp_path):
    shards = write_shards(
        _samples(audio_files), tmp_path / "s", shard_bytes=1, progress=False, shuffle=False
    )
    shard = tmp_path / "s" / shards.entries[2]["name"]
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError):
        build_spectrogram_cache(shards, tmp_path / "c", num_workers=0, progress=False)
    with pytest.raises(TypeError, match=r"ShardSet.open\(folder\)"):
        build_spectrogram_cache(str(tmp_path / "s"), tmp_path / "c", num_workers=0, progress=False)


def test_cli_takes_a_shard_folder(audio_files, tmp_path, capsys):
    from recipes.cli import main

    shards = write_shards(_samples(audio_files), tmp_path / "s", progress=False, shuffle=False)
    assert main(["cache", "audio", str(tmp_path / "s"), str(tmp_path / "c"), "--workers", "0"]) == 0
    assert "ragged layout" in capsys.readouterr().out
    stamp = (tmp_path / "c" / "features.bin").stat().st_mtime_ns
    build_spectrogram_cache(
        shards, tmp_path / "c", num_workers=0, progress=False
    )  # the same key: reused
    assert (tmp_path / "c" / "features.bin").stat().st_mtime_ns == stamp
