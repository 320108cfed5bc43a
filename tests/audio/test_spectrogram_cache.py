import os
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.audio import (
    ChunkedAudioDataset,
    SpectrogramCache,
    SpectrogramCacheError,
    build_spectrogram_cache,
)
from recipes.audio.spectrogram_cache import featurizer
from recipes.cli import main


def _on_the_fly(ds, i, **kw):
    params = dict(n_fft=400, hop_length=160, n_mels=80, log=True) | kw
    return featurizer(ds.sample_rate, **params)(ds[i][0])


def test_cached_features_equal_on_the_fly_to_float16_precision(audio_files, tmp_path):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=2.0)
    cache = build_spectrogram_cache(ds, tmp_path / "c", num_workers=2, progress=False)
    assert len(cache) == len(ds) and cache.header["layout"] == "fixed"
    assert cache.features.shape == (len(ds), 80, 201) and cache.features.dtype == np.float16
    for i in range(len(ds)):
        features, info = cache[i]
        expected = _on_the_fly(ds, i)
        assert features.dtype == torch.float32 and features.shape == expected.shape
        torch.testing.assert_close(
            features, expected.half().float(), rtol=0, atol=0
        )  # float16 rounding only
        assert info["file"] == int(ds.item_file[i]) and info["start"] == pytest.approx(
            ds.item_start[i] / 16000
        )
        assert info["frames"] == min(201, 1 + int(ds.item_frames[i]) // 160)


def test_utterances_are_ragged_with_lengths(audio_files, tmp_path):
    ds = ChunkedAudioDataset(audio_files)
    cache = build_spectrogram_cache(
        ds, tmp_path / "c", n_mels=40, log=False, dtype="float32", num_workers=0, progress=False
    )
    assert cache.header["layout"] == "ragged"
    assert cache.lengths.tolist() == [1001, 351, 71]
    for i in range(3):
        torch.testing.assert_close(cache[i][0], _on_the_fly(ds, i, n_mels=40, log=False))


def test_getitems_equals_getitem(audio_files, tmp_path):
    cache = build_spectrogram_cache(
        ChunkedAudioDataset(audio_files, chunk_seconds=1.0),
        tmp_path / "c",
        num_workers=0,
        progress=False,
    )
    for (features, info), i in zip(cache.__getitems__([7, 0, 3, 7]), [7, 0, 3, 7], strict=True):
        assert torch.equal(features, cache[i][0]) and info == cache[i][1]


def test_reused_when_inputs_match_and_rebuilt_when_not(audio_files, tmp_path):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=2.0)
    first = build_spectrogram_cache(ds, tmp_path / "c", num_workers=0, progress=False)
    stamp = (tmp_path / "c" / "features.bin").stat().st_mtime_ns
    again = build_spectrogram_cache(
        ChunkedAudioDataset(audio_files, chunk_seconds=2.0),
        tmp_path / "c",
        num_workers=0,
        progress=False,
    )
    assert again.fingerprint == first.fingerprint
    assert (tmp_path / "c" / "features.bin").stat().st_mtime_ns == stamp
    other_params = build_spectrogram_cache(
        ds, tmp_path / "c", n_mels=64, num_workers=0, progress=False
    )
    assert other_params.fingerprint != first.fingerprint and other_params.n_mels == 64
    other_chunks = build_spectrogram_cache(
        ChunkedAudioDataset(audio_files, chunk_seconds=1.0),
        tmp_path / "c",
        num_workers=0,
        progress=False,
    )
    assert other_chunks.fingerprint not in (first.fingerprint, other_params.fingerprint)


def test_changed_audio_file_invalidates(tmp_path):
    from recipes.testing import make_audio_files

    paths = make_audio_files(tmp_path / "a", count=2, seconds=2.0)
    first = build_spectrogram_cache(
        ChunkedAudioDataset(paths), tmp_path / "c", num_workers=0, progress=False
    )
    os.utime(paths[1], ns=(time.time_ns(), time.time_ns() + 10**9))
    second = build_spectrogram_cache(
        ChunkedAudioDataset(paths), tmp_path / "c", num_workers=0, progress=False
    )
    assert second.fingerprint != first.fingerprint


@pytest.mark.parametrize("damage", ["features", "offsets", "header"])
def test_truncated_or_corrupt_cache_is_refused_then_rebuilt(audio_files, tmp_path, damage):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=2.0)
    build_spectrogram_cache(ds, tmp_path / "c", num_workers=0, progress=False)
    if damage == "header":
        (tmp_path / "c" / "header.json").write_text("[]")
    else:
        f = tmp_path / "c" / f"{damage}.bin"
        f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(SpectrogramCacheError, match="rebuild|build it"):
        SpectrogramCache.open(tmp_path / "c")
    rebuilt = build_spectrogram_cache(ds, tmp_path / "c", num_workers=0, progress=False)
    torch.testing.assert_close(rebuilt[1][0], _on_the_fly(ds, 1).half().float())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp folders left


def test_in_workers(audio_files, tmp_path):
    from recipes.audio import pad_collate

    cache = build_spectrogram_cache(
        ChunkedAudioDataset(audio_files, chunk_seconds=1.0),
        tmp_path / "c",
        num_workers=0,
        progress=False,
    )
    loader = DataLoader(cache, batch_size=4, num_workers=2, collate_fn=pad_collate)
    got = torch.cat([b["inputs"] for b in loader])
    assert torch.equal(got, torch.stack([cache[i][0] for i in range(len(cache))]))


def test_cli_builds_the_same_cache(audio_files, tmp_path, capsys):
    folder = audio_files[0].parent
    assert (
        main(
            [
                "cache",
                "audio",
                str(folder),
                str(tmp_path / "c"),
                "--chunk-seconds",
                "2",
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert "fixed layout" in capsys.readouterr().out
    same = build_spectrogram_cache(
        ChunkedAudioDataset(folder, chunk_seconds=2.0),
        tmp_path / "c",
        progress=False,
        num_workers=0,
    )
    assert same.fingerprint == SpectrogramCache.open(tmp_path / "c").fingerprint


def test_features_truncated_after_open_raise_spectrogram_cache_error_naming_the_file(
    audio_files, tmp_path
):
    """Issue 19: numpy's "mmap length is greater than file size" named nothing."""
    path = tmp_path / "c"
    build_spectrogram_cache(
        ChunkedAudioDataset(audio_files, chunk_seconds=2.0), path, num_workers=0, progress=False
    )
    cache = SpectrogramCache.open(path)
    expected = (path / "features.bin").stat().st_size
    os.truncate(path / "features.bin", expected // 2)  # in place, before the first access
    message = (
        rf"{path / 'features.bin'} changed after the cache was opened: truncated in place; "
        rf"it is {expected // 2:,} bytes, expected {expected:,}\. Reopen the cache"
    )
    with pytest.raises(SpectrogramCacheError, match=message):
        cache[0]
    with pytest.raises(SpectrogramCacheError, match=message):
        _ = cache.features
    with pytest.raises(SpectrogramCacheError, match="truncated"):
        SpectrogramCache.open(path)
