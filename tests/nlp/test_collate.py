import pytest
import torch
from transformers import DataCollatorWithPadding

from recipes.nlp import PadCollate


def _items(lengths):
    return [{"input_ids": torch.arange(1, n + 1)} for n in lengths]


def test_right_padding_matches_transformers(tokenizer, corpus):
    texts = corpus[:7]
    encoded = [tokenizer(t) for t in texts]
    expected = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)(encoded)
    got = PadCollate(tokenizer.pad_token_id, pad_to_multiple_of=8)(
        [{"input_ids": torch.tensor(e["input_ids"])} for e in encoded]
    )
    assert torch.equal(got["input_ids"], expected["input_ids"])
    assert torch.equal(got["attention_mask"], expected["attention_mask"])
    assert got["lengths"].tolist() == [len(e["input_ids"]) for e in encoded]


def test_left_padding_labels_and_multiple():
    out = PadCollate(0, pad_to_multiple_of=4, padding_side="left", return_labels=True)(
        _items([3, 1, 5])
    )
    assert out["input_ids"].shape == (3, 8)
    assert out["input_ids"][0].tolist() == [0, 0, 0, 0, 0, 1, 2, 3]
    assert out["attention_mask"][1].tolist() == [0] * 7 + [1]
    assert out["labels"][0].tolist() == [-100] * 5 + [1, 2, 3]
    assert out["lengths"].tolist() == [3, 1, 5]


def test_bare_lists_and_empty_samples():
    out = PadCollate(9, pad_to_multiple_of=1)([[4, 5], [], torch.tensor([6])])
    assert out["input_ids"].tolist() == [[4, 5], [9, 9], [6, 9]]
    assert out["attention_mask"].tolist() == [[1, 1], [0, 0], [1, 0]]


def test_errors_name_the_item():
    with pytest.raises(TypeError, match="item 1 has input_ids of shape"):
        PadCollate(0)([torch.ones(2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="empty batch"):
        PadCollate(0)([])
    with pytest.raises(ValueError, match="`padding_side` must be 'right' or 'left'"):
        PadCollate(0, padding_side="middle")


def test_in_workers_one_shared_buffer(corpus, tokenizer, tmp_path):
    from torch.utils.data import DataLoader

    from recipes.nlp import LengthBucketSampler, build_token_cache

    cache = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False)
    sampler = LengthBucketSampler(cache.lengths, max_tokens=512, pad_to_multiple_of=8, seed=0)
    loader = DataLoader(
        cache, batch_sampler=sampler, num_workers=2, collate_fn=PadCollate(tokenizer.pad_token_id)
    )
    seen = []
    for batch, indices in zip(loader, sampler, strict=True):
        assert batch["input_ids"].shape[0] == len(indices)
        assert batch["input_ids"].numel() <= 512 or len(indices) == 1
        for row, i in enumerate(indices):
            n = int(batch["lengths"][row])
            assert batch["input_ids"][row, :n].tolist() == cache[i]["input_ids"].tolist()
        seen += indices
    assert sorted(seen) == list(range(len(cache)))


def test_make_loader_picks_the_text_profile_for_a_token_cache(
    corpus, tokenizer, tmp_path, monkeypatch
):
    from recipes.common import make_loader
    from recipes.nlp import LengthBucketSampler, build_token_cache

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # text never pins, even with CUDA
    cache = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False)
    sampler = LengthBucketSampler(cache.lengths, max_tokens=512, seed=0)
    loader = make_loader(
        cache, batch_sampler=sampler, collate_fn=PadCollate(tokenizer.pad_token_id), num_workers=0
    )
    assert loader.recipe.profile == "text" and loader.pin_memory is False
    assert "recommends the text profile" in loader.recipe.reasons["profile"]
    assert sum(len(b["lengths"]) for b in loader) == len(cache)
