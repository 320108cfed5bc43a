import gzip
import json
import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.cli import main
from recipes.nlp import TokenCache, TokenCacheError, build_token_cache
from recipes.testing import train_tokenizer
from recipes.testing_servers import LocalHTTPServer


def _direct(tokenizer, texts, **kw):
    return [tokenizer(t, **kw)["input_ids"] for t in texts]


@pytest.mark.parametrize("kwargs", [{}, {"add_special_tokens": False}, {"max_length": 12}])
def test_cache_equals_direct_tokenization(corpus, tokenizer, tmp_path, kwargs):
    cache = build_token_cache(
        corpus, tokenizer, tmp_path / "c", progress=False, batch_size=64, **kwargs
    )
    direct_kw = {"add_special_tokens": kwargs.get("add_special_tokens", True)}
    if "max_length" in kwargs:
        direct_kw.update(truncation=True, max_length=kwargs["max_length"])
    expected = _direct(tokenizer, corpus, **direct_kw)
    assert len(cache) == len(corpus)
    assert cache.lengths.tolist() == [len(e) for e in expected]
    for i, ids in enumerate(expected):
        item = cache[i]["input_ids"]
        assert item.dtype == torch.int64 and item.tolist() == ids
    assert cache.header["dtype"] == "uint16"
    batch = cache.__getitems__([5, 0, 150, 5])
    assert [b["input_ids"].tolist() for b in batch] == [expected[i] for i in (5, 0, 150, 5)]


def test_empty_strings_are_kept(corpus, tokenizer, tmp_path):
    cache = build_token_cache(
        corpus, tokenizer, tmp_path / "c", progress=False, add_special_tokens=False
    )
    assert cache.lengths[150] == 0 and cache[150]["input_ids"].numel() == 0
    with_special = build_token_cache(corpus, tokenizer, tmp_path / "s", progress=False)
    assert with_special[150]["input_ids"].tolist() == [
        tokenizer.cls_token_id,
        tokenizer.sep_token_id,
    ]


def test_large_vocabularies_use_uint32(corpus, tmp_path):
    big = train_tokenizer(corpus, vocab_size=600)
    big.add_tokens([f"zzword{i}" for i in range(66_000)])
    texts = ["zzword65999 alpha", corpus[0]]
    cache = build_token_cache(texts, big, tmp_path / "c", progress=False)
    assert cache.header["dtype"] == "uint32"
    assert cache[0]["input_ids"].tolist() == big(texts[0])["input_ids"]


def test_txt_jsonl_gzip_and_http_inputs(corpus, tokenizer, tmp_path):
    texts = [t for t in corpus if "\n" not in t]
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(
        "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts))
    )
    with gzip.open(tmp_path / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(texts) + "\n")
    expected = _direct(tokenizer, texts)
    sources = [tmp_path / "a.txt", str(tmp_path / "b.jsonl"), tmp_path / "c.txt.gz"]
    with LocalHTTPServer(tmp_path) as server:
        sources.append(server.url("a.txt"))
        for n, source in enumerate(sources):
            cache = build_token_cache(
                source, tokenizer, tmp_path / f"cache{n}", progress=False, text_field="body"
            )
            assert [cache[i]["input_ids"].tolist() for i in range(len(cache))] == expected, source


def test_parquet_and_shard_inputs_equal_the_jsonl_cache(corpus, tokenizer, tmp_path):
    """Parquet (a file of our own, one pyarrow wrote, and our Parquet shards over HTTP) gives the
    cache the same texts as JSONL gives: the same tokens and offsets; a missing column names it."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from recipes.common.shards.shard_writer import write_shards

    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in corpus))
    reference = build_token_cache(
        tmp_path / "t.jsonl", tokenizer, tmp_path / "j", progress=False, text_field="body"
    )
    pq.write_table(
        pa.table({"body": corpus, "n": list(range(len(corpus)))}),
        tmp_path / "t.parquet",
        row_group_size=37,
    )
    shards = write_shards(
        ({"__key__": f"k{i}", "body": t} for i, t in enumerate(corpus)),
        tmp_path / "shards",
        format="parquet",
        shard_bytes=1 << 30,
        progress=False,
        shuffle=False,
    )
    with LocalHTTPServer(tmp_path / "shards") as server:
        for n, source in enumerate([tmp_path / "t.parquet", server.url(shards.entries[0]["name"])]):
            cache = build_token_cache(
                source, tokenizer, tmp_path / f"p{n}", progress=False, text_field="body"
            )
            assert cache.lengths.tolist() == reference.lengths.tolist(), source
            assert all(
                torch.equal(cache[i]["input_ids"], reference[i]["input_ids"])
                for i in range(len(corpus))
            )
    with pytest.raises(ValueError, match="no column 'text'"):
        build_token_cache(tmp_path / "t.parquet", tokenizer, tmp_path / "x", progress=False)


def test_a_hugging_face_dataset_is_a_source(corpus, tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": corpus})
    cache = build_token_cache(ds, tokenizer, tmp_path / "c", progress=False)
    assert [cache[i]["input_ids"].tolist() for i in range(len(cache))] == _direct(tokenizer, corpus)
    with pytest.raises(ValueError, match="no column 'body'"):
        build_token_cache(ds, tokenizer, tmp_path / "d", progress=False, text_field="body")


def test_same_inputs_reuse_and_different_inputs_rebuild(corpus, tokenizer, tmp_path):
    first = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False)
    stamp = (tmp_path / "c" / "tokens.bin").stat().st_mtime_ns
    again = build_token_cache(list(corpus), tokenizer, tmp_path / "c", progress=False)
    assert again.fingerprint == first.fingerprint
    assert (tmp_path / "c" / "tokens.bin").stat().st_mtime_ns == stamp  # reused, not rebuilt
    changed = build_token_cache(
        corpus[:-1] + [corpus[-1] + " more"], tokenizer, tmp_path / "c", progress=False
    )
    assert changed.fingerprint != first.fingerprint
    assert (
        changed[len(corpus) - 1]["input_ids"].tolist()
        == tokenizer(corpus[-1] + " more")["input_ids"]
    )
    shorter = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False, max_length=5)
    assert shorter.fingerprint not in (first.fingerprint, changed.fingerprint)


@pytest.mark.parametrize(
    "call",
    [
        dict(truncation=True, max_length=512),
        dict(truncation=True, max_length=7, padding="max_length"),
        dict(padding=True),
        dict(),
    ],
)
def test_reuse_survives_direct_tokenizer_calls(corpus, tmp_path, call):
    tokenizer = train_tokenizer(corpus[:200], vocab_size=500)
    first = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False, max_length=64)
    stamp = (tmp_path / "c" / "tokens.bin").stat().st_mtime_ns
    tokenizer(corpus[:3], **call)  # leaves truncation/padding state in the Rust backend
    again = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False, max_length=64)
    assert again.fingerprint == first.fingerprint
    assert (
        tmp_path / "c" / "tokens.bin"
    ).stat().st_mtime_ns == stamp  # reused, not tokenized again
    assert (
        again[5]["input_ids"].tolist()
        == tokenizer(corpus[5], truncation=True, max_length=64)["input_ids"]
    )


def test_tokenizers_differing_in_one_special_token_never_share(corpus, tmp_path):
    a = train_tokenizer(corpus, vocab_size=600)
    b = train_tokenizer(corpus, vocab_size=600, special_tokens={"mask_token": "[MSK]"})
    assert a(corpus[0])["input_ids"] == b(corpus[0])["input_ids"]  # same output on this text...
    ca = build_token_cache(corpus, a, tmp_path / "c", progress=False)
    cb = build_token_cache(corpus, b, tmp_path / "c", progress=False)
    assert ca.fingerprint != cb.fingerprint  # ...but never the same cache
    a2 = train_tokenizer(corpus, vocab_size=600)
    assert (
        build_token_cache(corpus, a2, tmp_path / "d", progress=False).fingerprint == ca.fingerprint
    )


def test_pad_token_set_in_transformers_changes_the_key(corpus, tokenizer, tmp_path):
    import copy

    other = copy.deepcopy(tokenizer)
    other.pad_token = "[UNK]"
    a = build_token_cache(corpus, tokenizer, tmp_path / "a", progress=False)
    b = build_token_cache(corpus, other, tmp_path / "b", progress=False)
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize("damage", ["truncate_tokens", "truncate_offsets", "header"])
def test_truncated_or_corrupt_cache_is_refused_then_rebuilt(corpus, tokenizer, tmp_path, damage):
    path = tmp_path / "c"
    build_token_cache(corpus, tokenizer, path, progress=False)
    if damage == "header":
        (path / "header.json").write_text("{not json")
    else:
        f = path / ("tokens.bin" if damage == "truncate_tokens" else "offsets.bin")
        f.write_bytes(f.read_bytes()[:-6])
    with pytest.raises(TokenCacheError, match="rebuild|build it"):
        TokenCache.open(path)
    rebuilt = build_token_cache(corpus, tokenizer, path, progress=False)
    assert rebuilt[3]["input_ids"].tolist() == tokenizer(corpus[3])["input_ids"]
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temp folders left


def test_invalid_utf8_names_file_and_line(tokenizer, tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine\nalso fine\nbroken \xff\xfe here\n")
    with pytest.raises(ValueError, match=r"bad\.txt, line 3: invalid UTF-8"):
        build_token_cache(tmp_path / "bad.txt", tokenizer, tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_missing_text_field_names_the_line(tokenizer, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: no field 'text' \(found \['txt'\]\)"):
        build_token_cache(tmp_path / "d.jsonl", tokenizer, tmp_path / "c", progress=False)


def test_unknown_file_type(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown text file type"):
        build_token_cache(tmp_path / "corpus.csv", tokenizer, tmp_path / "c", progress=False)


class _WordTokenizer:
    """Built lazily: a slow (pure Python) word-level tokenizer, as transformers'
    PreTrainedTokenizer."""

    @staticmethod
    def make(words):
        from transformers import PreTrainedTokenizer

        class WordTokenizer(PreTrainedTokenizer):
            def __init__(self, vocab, **kw):
                self.vocab = dict(vocab)
                self.inverse = {i: t for t, i in self.vocab.items()}
                super().__init__(**kw)

            @property
            def vocab_size(self):
                return len(self.vocab)

            def get_vocab(self):
                return dict(self.vocab)

            def _tokenize(self, text):
                return text.split()

            def _convert_token_to_id(self, token):
                return self.vocab.get(token, self.vocab["[UNK]"])

            def _convert_id_to_token(self, index):
                return self.inverse.get(index, "[UNK]")

            def build_inputs_with_special_tokens(self, ids, pair=None):
                return [self.vocab["[CLS]"], *ids, self.vocab["[SEP]"]]

        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
        vocab = {t: i for i, t in enumerate(specials + sorted(set(words)))}
        return WordTokenizer(
            vocab, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
        )


def test_slow_tokenizer_works_with_a_warning(corpus, tmp_path):
    slow = _WordTokenizer.make(w for t in corpus[:100] for w in t.split())
    assert not slow.is_fast
    with pytest.warns(UserWarning, match="slow"):
        cache = build_token_cache(corpus[:20], slow, tmp_path / "c", progress=False, max_length=16)
    for i in (0, 4, 19):
        assert (
            cache[i]["input_ids"].tolist()
            == slow(corpus[i], truncation=True, max_length=16)["input_ids"]
        )
    with pytest.warns(UserWarning, match="slow"):
        again = build_token_cache(corpus[:20], slow, tmp_path / "c", progress=False, max_length=16)
    assert again.fingerprint == cache.fingerprint  # deterministic, never random


def test_pickles_cheaply_and_works_in_workers(corpus, tokenizer, tmp_path):
    cache = build_token_cache(corpus, tokenizer, tmp_path / "c", progress=False)
    blob = pickle.dumps(cache)
    assert len(blob) < 4096 + cache.offsets.nbytes + cache.lengths.nbytes  # no token data inside
    loader = DataLoader(cache, batch_size=None, num_workers=2)
    assert [x["input_ids"].tolist() for x in loader] == _direct(tokenizer, corpus)


def test_cli_builds_the_same_cache(corpus, tokenizer, tmp_path, monkeypatch):
    texts = [t for t in corpus if "\n" not in t]
    (tmp_path / "corpus.txt").write_text("\n".join(texts) + "\n")
    tokenizer.save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (
        main(
            [
                "cache",
                "nlp",
                str(tmp_path / "corpus.txt"),
                str(tmp_path / "tok"),
                str(tmp_path / "cache"),
                "--max-length",
                "32",
            ]
        )
        == 0
    )
    cache = TokenCache.open(tmp_path / "cache")
    assert len(cache) == len(texts)
    same = build_token_cache(
        tmp_path / "corpus.txt", tokenizer, tmp_path / "cache", max_length=32, progress=False
    )
    assert same.fingerprint == cache.fingerprint
    assert np.array_equal(same.lengths, cache.lengths)


def _first_item(dataset):
    return dataset[0]


def test_tokens_truncated_after_open_raise_token_cache_error_naming_the_file(
    corpus, tokenizer, tmp_path
):
    """Issue 19: numpy's "mmap length is greater than file size" named nothing."""
    path = tmp_path / "c"
    build_token_cache(corpus, tokenizer, path, progress=False)
    cache = TokenCache.open(path)
    expected = (path / "tokens.bin").stat().st_size
    os.truncate(path / "tokens.bin", expected - 6)  # in place, before the first access
    message = (
        rf"{path / 'tokens.bin'} changed after the cache was opened: truncated in place; "
        rf"it is {expected - 6:,} bytes, expected {expected:,}\. Reopen the cache"
    )
    with pytest.raises(TokenCacheError, match=message):
        cache[0]
    with pytest.raises(TokenCacheError, match=message):
        cache.__getitems__([0, 1])
    with ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("fork")
    ) as pool:  # a worker's first access
        with pytest.raises(TokenCacheError, match=message):
            pool.submit(_first_item, cache).result(timeout=60)
    with pytest.raises(TokenCacheError, match="truncated"):
        TokenCache.open(path)  # the fix the message names: reopening finds it, a rebuild repairs it


def test_a_rebuild_after_open_keeps_mapped_items_and_refuses_unmapped_copies(
    corpus, tokenizer, tmp_path
):
    path = tmp_path / "c"
    cache = build_token_cache(corpus, tokenizer, path, progress=False)
    first = cache[3]["input_ids"].tolist()  # mapped in this process
    worker_copy = pickle.loads(pickle.dumps(cache))  # as a worker started later receives it
    build_token_cache(corpus[::-1], tokenizer, path, progress=False)  # renamed into place
    assert (
        cache[3]["input_ids"].tolist() == first == tokenizer(corpus[3])["input_ids"]
    )  # the old inode
    with pytest.raises(
        TokenCacheError, match=r"tokens\.bin changed after the cache was opened: replaced"
    ):
        worker_copy[3]
    assert TokenCache.open(path)[3]["input_ids"].tolist() == tokenizer(corpus[-4])["input_ids"]
