import pickle

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio
from torch.utils.data import DataLoader

from recipes.audio import AudioDecodeError, ChunkedAudioDataset, pad_collate
from recipes.bench.harness.measure import peak_rss_growth
from recipes.common import PackedStrings
from recipes.testing import make_audio_files


def _expected_windows(paths, chunk, hop, last):
    """Independently: read every file whole and cut the windows."""
    out = []
    for f, path in enumerate(paths):
        data, rate = sf.read(path, dtype="float32", always_2d=True)
        total = len(data)
        c, h = round(chunk * rate), round(hop * rate)
        start = 0
        while start + c <= total:
            out.append((f, start, data[start : start + c].T, c))
            start += h
        last_end = start - h + c if start > 0 else 0
        if start < total and last_end < total and last != "drop":
            part = data[start:].T
            if last == "pad":
                part = np.pad(part, ((0, 0), (0, c - part.shape[1])))
            out.append((f, start, part, total - start))
    return out


@pytest.mark.parametrize("chunk, hop", [(4.0, None), (4.0, 1.5), (1.0, 1.0)])
@pytest.mark.parametrize("last", ["pad", "keep", "drop"])
def test_windows_equal_a_full_file_read(audio_files, chunk, hop, last):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=chunk, hop_seconds=hop, last_chunk=last)
    expected = _expected_windows(audio_files, chunk, hop or chunk, last)
    assert len(ds) == len(expected)
    for i, (f, start, wave, valid) in enumerate(expected):
        got, info = ds[i]
        assert got.dtype == torch.float32 and got.shape == wave.shape
        np.testing.assert_array_equal(got.numpy(), wave)
        assert info == {"file": f, "start": start / 16000, "frames": valid}


def test_utterance_mode_is_one_item_per_file(audio_files):
    ds = ChunkedAudioDataset(audio_files)
    assert len(ds) == 3 and ds.lengths.tolist() == [160000, 56000, 11200]
    for i, path in enumerate(audio_files):
        wave, info = ds[i]
        np.testing.assert_array_equal(wave.numpy()[0], sf.read(path, dtype="float32")[0])
        assert info["frames"] == len(sf.read(path)[0])


def test_index_lives_in_numpy_arrays(audio_files):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=2.0)
    assert isinstance(ds.files, PackedStrings)
    for array in (ds.item_file, ds.item_start, ds.item_frames):
        assert isinstance(array, np.ndarray)


def test_stereo_to_mono_and_kept_channels(tmp_path):
    [path] = make_audio_files(
        tmp_path, count=1, seconds=2.0, channels=2, format="WAV", subtype="FLOAT"
    )
    data, _ = sf.read(path, dtype="float32")
    mono, _ = ChunkedAudioDataset([path], chunk_seconds=1.0)[1]
    np.testing.assert_allclose(mono.numpy()[0], data[16000:32000].mean(axis=1), atol=1e-7)
    stereo, _ = ChunkedAudioDataset([path], chunk_seconds=1.0, mono=False)[1]
    assert stereo.shape == (2, 16000)


@pytest.mark.parametrize(
    "fmt, subtype", [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("OGG", "VORBIS"), ("FLAC", "PCM_24")]
)
def test_formats_and_subtypes(tmp_path, fmt, subtype):
    [path] = make_audio_files(tmp_path, count=1, seconds=3.0, format=fmt, subtype=subtype)
    ds = ChunkedAudioDataset([path], chunk_seconds=1.0)
    full, _ = sf.read(path, dtype="float32")
    wave, _ = ds[2]
    np.testing.assert_allclose(wave.numpy()[0], full[32000:48000], atol=1e-6)


def test_resampling_matches_torchaudio_and_caches_the_kernel(tmp_path):
    paths = make_audio_files(tmp_path / "a", count=1, seconds=3.0, sample_rate=22050, seed=1)
    paths += make_audio_files(tmp_path / "b", count=1, seconds=3.0, sample_rate=16000, seed=2)
    ds = ChunkedAudioDataset(paths, chunk_seconds=1.0, sample_rate=16000)
    wave, info = ds[1]  # the second window of the 22.05 kHz file
    assert wave.shape == (1, 16000) and info["frames"] == 16000
    source, _ = sf.read(paths[0], dtype="float32")
    expected = torchaudio.functional.resample(
        torch.from_numpy(source[22050:44100])[None], 22050, 16000
    )
    torch.testing.assert_close(wave, expected)
    ds[0], ds[2], ds[3]
    assert list(ds._resamplers) == [22050]  # one kernel, reused
    assert ds.lengths.tolist() == [16000] * 6


def test_different_rates_without_sample_rate_is_an_error(tmp_path):
    paths = make_audio_files(tmp_path / "a", count=1, seconds=1.0, sample_rate=8000)
    paths += make_audio_files(tmp_path / "b", count=1, seconds=1.0, sample_rate=16000)
    with pytest.raises(
        ValueError, match="different sample rates.*8000 Hz.*16000 Hz.*pass sample_rate="
    ):
        ChunkedAudioDataset(paths)


def _bad_files(tmp_path):
    [good_wav] = make_audio_files(tmp_path / "w", count=1, seconds=2.0, format="WAV")
    [good_flac] = make_audio_files(tmp_path / "f", count=1, seconds=2.0, format="FLAC")
    bad = {
        "empty.wav": b"",
        "noise.flac": bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)),
        "page.wav": b"<html><body>502 Bad Gateway</body></html>",
        "truncated.wav": good_wav.read_bytes()[: len(good_wav.read_bytes()) // 2],
        "truncated.flac": good_flac.read_bytes()[: len(good_flac.read_bytes()) // 2],
    }
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    return good_wav, [tmp_path / name for name in bad]


def test_bad_files_fail_at_index_time_naming_the_file(tmp_path):
    good, bad = _bad_files(tmp_path)
    for path in bad:
        with pytest.raises(AudioDecodeError) as error:
            ChunkedAudioDataset([good, path], chunk_seconds=1.0)
        assert isinstance(error.value, ValueError) and path.name in str(error.value), path


def _with_wav_rate(path, rate):
    data = bytearray(path.read_bytes())
    assert data[12:16] == b"fmt "
    data[24:28] = int(rate).to_bytes(4, "little")  # fmt chunk: sample rate
    path.write_bytes(bytes(data))


def test_a_corrupt_header_rate_is_refused_at_index_time(tmp_path):
    [good, corrupt] = make_audio_files(tmp_path, count=2, seconds=1.0, format="WAV")
    _with_wav_rate(corrupt, 16_209_442)  # the fuzz case of issue #10: 519 GB asked for
    with pytest.raises(AudioDecodeError, match=r"audio_0001.wav.*16,209,442 Hz.*corrupt"):
        ChunkedAudioDataset([good, corrupt], chunk_seconds=0.5, sample_rate=16000)
    _with_wav_rate(corrupt, 44_101)  # plausible, but resampling to 16 kHz needs a 2.7 GB kernel
    with pytest.raises(
        AudioDecodeError, match=r"audio_0001.wav.*44,101 Hz to 16,000 Hz.*MiB kernel"
    ):
        ChunkedAudioDataset([good, corrupt], chunk_seconds=0.5, sample_rate=16000)


@pytest.mark.parametrize("damage", ["remove", "truncate", "garble"])
def test_a_file_damaged_after_indexing_raises_the_project_error(tmp_path, damage):
    paths = make_audio_files(tmp_path, count=2, seconds=2.0, format="FLAC")
    ds = ChunkedAudioDataset(paths, chunk_seconds=0.5)
    victim = paths[1]
    if damage == "remove":
        victim.unlink()
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:200])
    else:
        victim.write_bytes(b"\0" * 4000)
    index = int(np.flatnonzero(ds.item_file == 1)[-1])
    with pytest.raises(AudioDecodeError, match=rf"audio_0001.flac' \(item {index}\)"):
        ds[index]
    assert ds[0][0].shape[-1] == 8000  # the other file still reads


def test_zero_frame_file_warns_and_contributes_nothing(tmp_path):
    [good] = make_audio_files(tmp_path, count=1, seconds=2.0, format="WAV")
    sf.write(tmp_path / "silent.wav", np.zeros((0,), np.float32), 16000)
    with pytest.warns(UserWarning, match="silent.wav.*no frames"):
        ds = ChunkedAudioDataset([tmp_path / "silent.wav", good], chunk_seconds=1.0)
    assert len(ds) == 2 and set(ds.item_file.tolist()) == {1}


def test_invalid_arguments(audio_files, tmp_path):
    with pytest.raises(ValueError, match="`chunk_seconds` must be positive, but is -1.0 instead."):
        ChunkedAudioDataset(audio_files, chunk_seconds=-1.0)
    with pytest.raises(ValueError, match="`last_chunk` must be"):
        ChunkedAudioDataset(audio_files, chunk_seconds=1.0, last_chunk="wrap")
    with pytest.raises(ValueError, match="No audio files under"):
        ChunkedAudioDataset(tmp_path)


@pytest.mark.slow  # 3-6 s
def test_memory_per_item_follows_the_window_not_the_file(tmp_path):
    """A 10-minute file: reading a 4 s window grows RSS by the window, a whole read by the file."""
    [path] = make_audio_files(tmp_path, count=1, seconds=600.0, seed=8)
    ds = ChunkedAudioDataset([path], chunk_seconds=4.0)
    ds[0]
    window = peak_rss_growth(lambda: ds[len(ds) // 2])
    whole = peak_rss_growth(lambda: sf.read(path, dtype="float32"))
    assert whole > 30 * 2**20  # 9.6 M float32 samples
    assert window < 4 * 2**20, window


def test_pickles_and_workers_match_the_main_process(audio_files):
    ds = pickle.loads(pickle.dumps(ChunkedAudioDataset(audio_files, chunk_seconds=2.0)))
    main = [ds[i][0] for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=pad_collate)
    got = torch.cat([b["inputs"] for b in loader])
    assert torch.equal(got, torch.stack(main))
