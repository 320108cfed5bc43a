import pytest
import torch

from recipes.audio import AudioPadCollate, ChunkedAudioDataset, LengthBucketSampler, pad_collate


def test_pads_waveforms_and_reports_valid_frames(audio_files):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=4.0, last_chunk="keep")
    items = [ds[i] for i in range(len(ds))]
    out = pad_collate(items)
    longest = max(w.shape[-1] for w, _ in items)
    assert out["inputs"].shape == (len(items), 1, longest)
    assert out["lengths"].tolist() == [w.shape[-1] for w, _ in items]
    for row, (w, _) in enumerate(items):
        assert torch.equal(out["inputs"][row, :, : w.shape[-1]], w)
        assert (out["inputs"][row, :, w.shape[-1] :] == 0).all()
    assert out["file"].tolist() == [info["file"] for _, info in items]


def test_padded_windows_report_their_valid_frames(audio_files):
    ds = ChunkedAudioDataset(audio_files, chunk_seconds=4.0)  # last_chunk="pad"
    out = pad_collate([ds[i] for i in range(len(ds))])
    assert out["inputs"].shape[-1] == 64000
    assert out["lengths"].tolist() == ds.item_frames.tolist()


def test_features_and_multiple():
    out = AudioPadCollate(-13.8, pad_to_multiple_of=8)([torch.ones(80, 5), torch.ones(80, 11)])
    assert out["inputs"].shape == (2, 80, 16)
    assert out["inputs"][0, 0, 5:].eq(-13.8).all()
    assert out["lengths"].tolist() == [5, 11]


def test_mismatched_channels_name_the_item():
    with pytest.raises(TypeError, match="item 1 has shape"):
        pad_collate([torch.ones(1, 10), torch.ones(2, 10)])


def test_duration_budget_counts_padded_frames(tmp_path):
    from recipes.testing import make_audio_files

    seconds = [0.3, 0.5, 0.8, 1.0, 2.0, 3.5, 6.0, 0.4, 1.2, 2.5]
    ds = ChunkedAudioDataset(make_audio_files(tmp_path, seconds=seconds, sample_rate=8000))
    budget = 8000 * 7  # 7 s of padded audio per batch
    sampler = LengthBucketSampler(ds.lengths, max_tokens=budget, seed=0)
    seen = []
    for indices in sampler:
        batch = pad_collate([ds[i] for i in indices])
        assert batch["inputs"].shape[0] * batch["inputs"].shape[-1] <= budget  # padded, not summed
        seen += indices
    assert sorted(seen) == list(range(len(seconds)))
