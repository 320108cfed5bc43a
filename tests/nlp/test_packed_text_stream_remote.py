"""Issue 49, end to end: a corpus of Parquet, JSONL.gz and JSONL.zst files read where it lives,
on a fake Hugging Face Hub (`hf://`) and on S3 (moto), tokenized and packed on the fly over
2 ranks x 2 workers: the rows rebuilt into documents equal the tokenizer applied to each
document directly (every document's tokens exactly once, none altered at a row boundary); a
stop at a random batch resumed on another shape from rank 0's state gives every token once."""

from __future__ import annotations

import collections
import gzip
import json
import os
import random

import pytest

from recipes.common import StatefulLoader
from recipes.common.corpora.text_corpus import open_text_corpus
from recipes.nlp.streaming.packed_text_stream import PackedTextStream
from recipes.testing import make_text_corpus
from recipes.testing_hub import LocalHub, use_hub_endpoint
from recipes.testing_servers import MotoS3Server

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
pytest.importorskip("huggingface_hub")

SEQ_LEN = 40
BATCH = 3
FILES = ("a.parquet", "b.jsonl.gz", "c.jsonl.zst")


def _write(folder, texts):
    """Texts over a Parquet file (3 row groups), a JSONL.gz and a JSONL.zst, in `FILES`' order."""
    folder.mkdir(parents=True, exist_ok=True)
    third = len(texts) // 3
    parts = [texts[:third], texts[third : 2 * third], texts[2 * third :]]
    pq.write_table(pa.table({"text": parts[0]}), folder / FILES[0], row_group_size=third // 3)
    lines = [("".join(json.dumps({"text": t}) + "\n" for t in part)).encode() for part in parts]
    (folder / FILES[1]).write_bytes(gzip.compress(lines[1], mtime=0))
    (folder / FILES[2]).write_bytes(zstandard.ZstdCompressor().compress(lines[2]))
    return parts


@pytest.fixture(scope="module")
def texts():
    return [t for t in make_text_corpus(150, median_words=18, seed=9) if t.strip()]


def _expected(parts, tokenizer):
    """(file, row) -> the tokenizer applied to that document directly."""
    out = {}
    for file, part in enumerate(parts):
        for row, tokens in enumerate(tokenizer(part)["input_ids"]):
            out[(file, row)] = list(tokens)
    return out


def _loader(corpus, tokenizer, rank, world, workers):
    documents = corpus.dataset(rank=rank, world_size=world, seed=4, even=False)
    stream = PackedTextStream(documents, tokenizer, seq_len=SEQ_LEN, id_key=("file", "row"))
    return StatefulLoader(
        stream, batch_size=BATCH, num_workers=workers, collate_fn=stream.collate(BATCH)
    )


def _pieces(batch):
    """((file, row), start, tokens) of every piece of a batch."""
    out = []
    for r, (ids, starts) in enumerate(zip(batch["doc_ids"], batch["doc_starts"], strict=True)):
        lengths = batch["seq_lens"][r][: len(ids)].tolist()
        row = batch["input_ids"][r].tolist()
        at = 0
        for doc, start, n in zip(ids, starts, lengths, strict=True):
            out.append((tuple(int(v) for v in doc), int(start), row[at : at + n]))
            at += n
    return out


def _rebuilt(pieces):
    """Documents rebuilt from their pieces; a repeated or missing token position fails."""
    parts = collections.defaultdict(list)
    for doc, start, tokens in pieces:
        parts[doc].append((start, tokens))
    docs = {}
    for doc, found in parts.items():
        tokens = []
        for start, piece in sorted(found):
            assert start == len(tokens), f"document {doc}: a piece at {start} after {len(tokens)}"
            tokens.extend(piece)
        docs[doc] = tokens
    return docs


def _epoch_and_resume(corpus, tokenizer, expected):
    """A whole epoch on 2 x 2; then one stopped at a random batch on 2 x 2 and resumed on 3 x 1
    from rank 0's state: every document's tokens once, in both."""
    pieces = []
    for rank in range(2):
        for batch in _loader(corpus, tokenizer, rank, 2, 2):
            pieces += _pieces(batch)
    assert _rebuilt(pieces) == expected

    stop = random.Random(7).randrange(1, 6)
    pieces = []
    state = None
    for rank in range(2):
        loader = _loader(corpus, tokenizer, rank, 2, 2)
        iterator = iter(loader)
        for _ in range(stop):
            pieces += _pieces(next(iterator))
        if rank == 0:
            state = json.loads(json.dumps(loader.state_dict()))
        del iterator
    assert len(json.dumps(state)) < 4096
    for rank in range(3):
        loader = _loader(corpus, tokenizer, rank, 3, 1)
        loader.load_state_dict(state)
        for batch in loader:
            pieces += _pieces(batch)
    assert _rebuilt(pieces) == expected


def test_a_corpus_on_a_fake_hub_tokenized_and_packed_on_2x2_and_resumed_on_3x1(
    tmp_path, texts, tokenizer
):
    parts = _write(tmp_path / "hub" / "owner" / "corpus" / "data", texts)
    with LocalHub(tmp_path / "hub") as hub, use_hub_endpoint(hub.endpoint):
        corpus = open_text_corpus(
            "hf://datasets/owner/corpus/data", index_dir=tmp_path / "index"
        ).plan(progress=False)
        assert [u.rsplit("/", 1)[-1] for u in corpus.urls] == list(FILES)
        _epoch_and_resume(corpus, tokenizer, _expected(parts, tokenizer))


@pytest.mark.slow  # moto's server: about 7 s
def test_a_corpus_on_s3_tokenized_and_packed_on_2x2_and_resumed_on_3x1(
    tmp_path, texts, tokenizer, monkeypatch
):
    import s3fs

    parts = _write(tmp_path / "src", texts)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with MotoS3Server() as server:
        server.client().create_bucket(Bucket="packed")  # its own bucket: moto's may be shared
        options = server.storage_options()
        fs = s3fs.S3FileSystem(**options)
        for name in os.listdir(tmp_path / "src"):
            fs.put(str(tmp_path / "src" / name), f"packed/corpus/{name}")
        corpus = open_text_corpus(
            "s3://packed/corpus", storage_options=options, index_dir=tmp_path / "index"
        ).plan(progress=False)
        assert [u.rsplit("/", 1)[-1] for u in corpus.urls] == list(FILES)
        _epoch_and_resume(corpus, tokenizer, _expected(parts, tokenizer))


def test_documents_dealt_evenly_are_refused_their_repeats_would_be_packed_twice(
    tmp_path, texts, tokenizer
):
    _write(tmp_path / "src", texts)
    corpus = open_text_corpus(str(tmp_path / "src"), index_dir=tmp_path / "index")
    with pytest.raises(ValueError, match="even=False"):
        PackedTextStream(corpus.dataset(rank=0, world_size=2), tokenizer, seq_len=SEQ_LEN)


def _hub_corpus(tmp_path, texts, *, files=FILES):
    parts = _write(tmp_path / "hub" / "owner" / "corpus" / "data", texts)
    return parts, [f"hf://datasets/owner/corpus/data/{name}" for name in files]


def _documents_seen(corpus, ranks, *, world, workers, cache=None):
    """(file, row) of every document the given ranks' loaders yield, counted."""
    seen = collections.Counter()
    for rank in ranks:
        ds = corpus.dataset(rank=rank, world_size=world, seed=3, even=False, cache=cache)
        loader = StatefulLoader(ds, batch_size=8, num_workers=workers)
        for batch in loader:
            seen.update(zip(batch["file"].tolist(), batch["row"].tolist(), strict=True))
    return seen


def test_two_nodes_on_the_hub_download_each_object_once_per_node(tmp_path, texts):
    """2 simulated nodes x 2 ranks x 2 workers, each node its own PrefetchCache: every document
    once, and each JSONL object downloaded at most once per node over the epoch."""
    from recipes.common import PrefetchCache

    parts, urls = _hub_corpus(tmp_path, texts)
    jsonl = urls[1:]  # compressed JSONL: read whole, through the node's cache
    with LocalHub(tmp_path / "hub") as hub, use_hub_endpoint(hub.endpoint):
        corpus = open_text_corpus(jsonl, index_dir=tmp_path / "index").plan(progress=False)
        planned = collections.Counter(hub.gets)
        seen = collections.Counter()
        for node in range(2):
            cache = PrefetchCache(tmp_path / f"node{node}", max_bytes=2**30)
            seen += _documents_seen(
                corpus, [2 * node, 2 * node + 1], world=4, workers=2, cache=cache
            )
        read = hub.gets - planned
    assert set(seen.values()) == {1} and len(seen) == len(parts[1]) + len(parts[2])
    keys = [u.removeprefix("hf://datasets/") for u in jsonl]
    assert set(read) <= set(keys) and all(read[k] <= 2 for k in keys), read


@pytest.mark.slow  # huggingface_hub waits Retry-After + 1 s per 429: about 20 s
def test_a_429_storm_on_the_hub_completes_the_epoch_and_honours_retry_after(tmp_path, texts):
    parts, urls = _hub_corpus(tmp_path, texts)
    folder = "hf://datasets/owner/corpus/data"
    with LocalHub(tmp_path / "hub", retry_after=1) as hub, use_hub_endpoint(hub.endpoint):
        hub.limit_path["owner/corpus"] = 2  # repository info: huggingface_hub does not retry it
        corpus = open_text_corpus(folder, index_dir=tmp_path / "index").plan(progress=False)
        assert hub.throttled["owner/corpus"] == 2 and len(corpus.urls) == len(urls)
        hub.log.clear()
        hub.limit_next = 6  # the epoch's next 6 requests, whatever they are, answer 429
        # one client at a time (ranks in turn, no workers): the log's next request for a key is
        # that client's retry
        seen = _documents_seen(corpus, [0, 1], world=2, workers=0)
        log = list(hub.log)
        hub.limit_next = 6  # and a storm under 2 ranks x 2 workers: nothing lost
        assert _documents_seen(corpus, [0, 1], world=2, workers=2) == seen
    assert set(seen.values()) == {1} and len(seen) == sum(len(p) for p in parts)
    throttled = [r for r in log if r.status == 429]
    assert len(throttled) == 6
    for refused in throttled:  # the same request again no sooner than Retry-After
        again = [r for r in log if r.key == refused.key and r.at > refused.at and r.status != 429]
        assert again and min(r.at for r in again) - refused.at >= 1.0 - 0.05, refused


def test_an_object_changed_on_the_hub_is_refused_by_name(tmp_path, texts):
    from recipes.common.corpora.corpus_objects import CorpusChangedError

    _, urls = _hub_corpus(tmp_path, texts)
    with LocalHub(tmp_path / "hub") as hub, use_hub_endpoint(hub.endpoint):
        corpus = open_text_corpus(urls, index_dir=tmp_path / "index").plan(progress=False)
        hub.write_file(
            "owner/corpus",
            "data/a.parquet",
            (tmp_path / "hub/owner/corpus/data/b.jsonl.gz").read_bytes(),
        )
        with pytest.raises(CorpusChangedError, match="a.parquet"):
            _documents_seen(corpus, [0], world=1, workers=0)
        replanned = open_text_corpus(urls, index_dir=tmp_path / "index")
        with pytest.raises(Exception, match="a.parquet"):  # its new content is no Parquet
            replanned.plan(progress=False)
