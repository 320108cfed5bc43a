"""The shared contract every dataset and sampler of the library passes (STYLE.md, Tests).

- map-style datasets: items survive pickling, and DataLoader(num_workers=2) yields exactly
  what the main process reads, in order;
- samplers: deterministic for a seed, picklable, and resuming from a JSON round-tripped
  state_dict equals the uninterrupted run.
"""

import json
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.testing import (
    make_audio_files,
    make_image_folder,
    make_text_corpus,
    train_tokenizer,
)


def _image_folder(tmp):
    from recipes.vision import ImageFolderFast

    return ImageFolderFast(make_image_folder(tmp / "img", classes=2, per_class=3), size=64)


def _image_cache(tmp):
    from recipes.vision import build_image_cache

    ds = _image_folder(tmp)
    build_image_cache(ds, tmp / "imgcache", num_workers=0, progress=False)
    return ds


def _token_cache(tmp):
    from recipes.nlp import build_token_cache

    texts = make_text_corpus(40, seed=1)
    return build_token_cache(
        texts, train_tokenizer(texts, vocab_size=300), tmp / "tok", progress=False
    )


def _audio_windows(tmp):
    from recipes.audio import ChunkedAudioDataset

    return ChunkedAudioDataset(
        make_audio_files(tmp / "wav", seconds=[2.5, 1.0], sample_rate=8000), chunk_seconds=1.0
    )


def _spectrograms(tmp):
    from recipes.audio import build_spectrogram_cache

    return build_spectrogram_cache(_audio_windows(tmp), tmp / "mel", num_workers=0, progress=False)


DATASETS = {
    "ImageFolderFast": _image_folder,
    "ImageFolderFast+cache": _image_cache,
    "TokenCache": _token_cache,
    "ChunkedAudioDataset": _audio_windows,
    "SpectrogramCache": _spectrograms,
}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _identity(batch):
    return batch


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_dataset_contract(tmp_path, name):
    ds = DATASETS[name](tmp_path)
    main = [ds[i] for i in range(len(ds))]
    clone = pickle.loads(pickle.dumps(ds))
    assert all(_same(clone[i], main[i]) for i in range(len(ds))), "pickling changed the items"
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=_identity)
    from_workers = [item for batch in loader for item in batch]
    assert len(from_workers) == len(main)
    assert all(_same(a, b) for a, b in zip(from_workers, main, strict=True)), (
        "workers disagree with the main process"
    )


def _sampler(**kw):
    from recipes.common import LengthBucketSampler

    lengths = np.random.default_rng(0).integers(1, 120, 257)
    return LengthBucketSampler(lengths, max_tokens=500, seed=11, **kw)


@pytest.mark.parametrize("world", [1, 3])
def test_sampler_contract(world):
    samplers = [_sampler(num_replicas=world, rank=r) for r in range(world)]
    for s in samplers:
        s.set_epoch(4)
        again = _sampler(num_replicas=world, rank=s.rank)
        again.set_epoch(4)
        assert list(s) == list(again), "not deterministic for a seed"
        assert list(pickle.loads(pickle.dumps(s))) == list(s), "pickling changed the order"
        full = list(s)
        for stop in (0, 1, len(full) // 2, len(full)):
            head = full[:stop]
            state = json.loads(json.dumps(s.state_dict(batches_done=stop)))
            resumed = _sampler(num_replicas=world, rank=s.rank)
            resumed.load_state_dict(state)
            assert head + list(resumed) == full, f"resume at {stop} differs"
