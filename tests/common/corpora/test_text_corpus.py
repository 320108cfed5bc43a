"""open_text_corpus: Parquet and JSONL (plain, gzip) corpora, local, on S3 and over HTTP, read as
a shard set with every document once over ranks and workers; the local index; changed and
damaged objects refused by name; nothing written beside the source."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from recipes.common import PrefetchCache, make_loader
from recipes.common.corpora import text_corpus
from recipes.common.corpora.corpus_objects import CorpusChangedError, CorpusFormatError
from recipes.common.corpora.text_corpus import open_text_corpus
from recipes.testing import make_text_corpus
from recipes.testing_servers import (
    FaultInjectingHandler,
    LocalHTTPServer,
    MotoS3Server,
    _FixtureHTTPServer,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_corpus(folder: Path, texts: list[str]) -> dict[str, list[str]]:
    """Texts split over a Parquet file of 4 row groups, a JSONL and a JSONL.gz; each file's."""
    folder.mkdir(parents=True, exist_ok=True)
    third = len(texts) // 3
    parts = {
        "a.parquet": texts[:third],
        "b.jsonl": texts[third : 2 * third],
        "c.jsonl.gz": texts[2 * third :],
    }
    table = pa.table({"text": parts["a.parquet"], "lang": ["en"] * third})
    pq.write_table(table, folder / "a.parquet", row_group_size=max(1, third // 4))
    write_jsonl(folder / "b.jsonl", parts["b.jsonl"])
    write_jsonl(folder / "c.jsonl.gz", parts["c.jsonl.gz"])
    return parts


def write_jsonl(path: Path, texts: list[str]) -> None:
    data = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def documents(corpus, *, ranks: int, workers: int, epoch: int = 0, **kwargs) -> Counter:
    """(file, row) of every document the ranks' loaders yield, counted; checks each text."""
    seen = Counter()
    for rank in range(ranks):
        ds = corpus.dataset(rank=rank, world_size=ranks, seed=3, **kwargs)
        ds.set_epoch(epoch)
        loader = make_loader(ds, batch_size=8, num_workers=workers, path="workers")
        for batch in loader:
            seen.update(zip(batch["file"].tolist(), batch["row"].tolist(), strict=True))
    return seen


@pytest.fixture
def corpus_dir(tmp_path):
    texts = make_text_corpus(240, median_words=10, seed=4)
    parts = write_corpus(tmp_path / "src", texts)
    return tmp_path / "src", parts


def test_every_document_once_over_2_ranks_x_2_workers_and_nothing_written_beside_it(
    tmp_path, corpus_dir
):
    src, parts = corpus_dir
    before = listing(src)
    corpus = open_text_corpus(str(src), index_dir=tmp_path / "index").plan(progress=False)
    assert [Path(u).name for u in corpus.urls] == list(parts)
    assert corpus.lengths.tolist() == [80, 80, 80]
    seen = documents(corpus, ranks=2, workers=2)
    assert set(seen.values()) == {1}
    assert set(seen) == {(f, r) for f in range(3) for r in range(80)}
    assert listing(src) == before  # not a byte beside the source
    assert len(list((tmp_path / "index").glob("*.json"))) == 3


def test_documents_carry_their_text_and_columns(tmp_path, corpus_dir):
    src, parts = corpus_dir
    corpus = open_text_corpus(f"{src}/*.parquet", columns=["lang"], index_dir=tmp_path / "i")
    ds = corpus.dataset(shuffle=False)
    rows = list(ds)
    assert [r["text"] for r in rows] == parts["a.parquet"]
    assert {r["lang"] for r in rows} == {"en"}
    jsonl = open_text_corpus(str(src / "c.jsonl.gz"), columns=["id"], index_dir=tmp_path / "i")
    rows = list(jsonl.dataset(shuffle=False))
    assert [r["text"] for r in rows] == parts["c.jsonl.gz"]
    assert [r["id"] for r in rows] == list(range(80))


def test_the_index_is_reused_and_a_changed_object_planned_again(tmp_path, corpus_dir, monkeypatch):
    src, _ = corpus_dir
    open_text_corpus(str(src), index_dir=tmp_path / "index").plan(progress=False)
    planned = []
    for name in ("plan_parquet", "plan_jsonl"):
        original = getattr(text_corpus, name)

        def counting(*args, _original=original, **kwargs):
            planned.append(args[1])
            return _original(*args, **kwargs)

        monkeypatch.setattr(text_corpus, name, counting)
    corpus = open_text_corpus(str(src), index_dir=tmp_path / "index").plan(progress=False)
    assert planned == []  # every plan from the index
    write_jsonl(src / "b.jsonl", ["a new text", "and another"])
    corpus = open_text_corpus(str(src), index_dir=tmp_path / "index").plan(progress=False)
    assert planned == [str(src / "b.jsonl")]
    assert corpus.lengths.tolist() == [80, 2, 80]
    rows = [r["text"] for r in corpus.dataset(shuffle=False) if r["file"] == 1]
    assert rows == ["a new text", "and another"]


@pytest.mark.parametrize(
    "damage",
    [{"rows": 81}, {"rows": -1}, {"rows": "80"}, {"row_groups": 5}, {"format": "csv"}, "[1, 2]"],
)
def test_a_damaged_index_entry_is_planned_again_never_served(tmp_path, corpus_dir, damage):
    """An entry whose header is right but whose plan was altered (a bit flipped, a hand edit)
    was served: a wrong row count read as 'the object changed', a wrong type crashed."""
    src, parts = corpus_dir
    index = tmp_path / "index"
    open_text_corpus(str(src / "b.jsonl"), index_dir=index).plan(progress=False)
    (entry,) = index.glob("*.json")
    if isinstance(damage, dict):
        entry.write_text(json.dumps({**json.loads(entry.read_text()), **damage}))
    else:
        entry.write_text(damage)
    corpus = open_text_corpus(str(src / "b.jsonl"), index_dir=index).plan(progress=False)
    assert corpus.lengths.tolist() == [80]
    assert [r["text"] for r in corpus.dataset(shuffle=False)] == parts["b.jsonl"]
    again = open_text_corpus(str(src / "b.jsonl"), index_dir=index)
    assert again.plan(progress=False).plans == corpus.plans  # the entry was written anew


def test_an_index_folder_that_cannot_be_written_warns_and_plans_on(tmp_path, corpus_dir):
    src, parts = corpus_dir
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the index folder should be")
    corpus = open_text_corpus(str(src / "b.jsonl"), index_dir=blocked)
    with pytest.warns(UserWarning, match="cannot be written"):
        corpus.plan(progress=False)
    assert [r["text"] for r in corpus.dataset(shuffle=False)] == parts["b.jsonl"]


@pytest.mark.parametrize("name", ["a.parquet", "b.jsonl", "c.jsonl.gz"])
def test_an_object_changed_mid_epoch_is_refused_by_name(tmp_path, corpus_dir, name):
    src, parts = corpus_dir
    corpus = open_text_corpus(str(src / name), index_dir=tmp_path / "index").plan(progress=False)
    texts = list(reversed(parts[name]))  # same rows, same size, other content
    if name.endswith(".parquet"):
        pq.write_table(
            pa.table({"text": texts, "lang": ["en"] * 80}), src / name, row_group_size=20
        )
    else:
        write_jsonl(src / name, texts)
    with pytest.raises(CorpusChangedError, match=name):
        list(corpus.dataset(shuffle=False))


def test_damaged_objects_are_refused_by_name(tmp_path, corpus_dir):
    src, _ = corpus_dir
    data = (src / "a.parquet").read_bytes()
    (src / "a.parquet").write_bytes(data[:-100])  # the footer cut
    with pytest.raises(CorpusFormatError, match="a.parquet"):
        open_text_corpus(str(src / "a.parquet"), index_dir=tmp_path / "i").plan(progress=False)
    data = (src / "c.jsonl.gz").read_bytes()
    (src / "c.jsonl.gz").write_bytes(data[: len(data) // 2])  # a truncated gzip
    with pytest.raises(CorpusFormatError, match="c.jsonl.gz"):
        open_text_corpus(str(src / "c.jsonl.gz"), index_dir=tmp_path / "i").plan(progress=False)
    (src / "d.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    corpus = open_text_corpus(str(src / "d.jsonl"), index_dir=tmp_path / "i")
    with pytest.raises(CorpusFormatError, match=r"d.jsonl: row 1 has no 'text'"):
        list(corpus.dataset(shuffle=False))


@pytest.mark.parametrize("damage", ["truncated", "not zstd", "junk after the frames"])
def test_a_damaged_zstd_object_is_refused_by_name_when_planned_and_at_once(tmp_path, damage):
    """zstandard's stream reader ends quietly where a frame is cut short (a truncated object
    planned as fewer rows) and raises ZstdError, not a format error, on garbage (retried as
    transient, then raised without the object's name)."""
    zstandard = pytest.importorskip("zstandard")
    texts = [f"document {i} " * 8 for i in range(3000)]
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    half = len(data) // 2  # two frames: a corpus written in parts
    frames = [zstandard.ZstdCompressor().compress(part) for part in (data[:half], data[half:])]
    (tmp_path / "whole.jsonl.zst").write_bytes(b"".join(frames))
    whole = open_text_corpus(str(tmp_path / "whole.jsonl.zst"), index_dir=tmp_path / "i")
    assert [r["text"] for r in whole.dataset(shuffle=False)] == texts
    blob = {
        "truncated": frames[0] + frames[1][: len(frames[1]) // 2],
        "not zstd": b"\x00 not a zstd stream" * 40,
        "junk after the frames": b"".join(frames) + b"\x01\x02junk",
    }[damage]
    (tmp_path / "bad.jsonl.zst").write_bytes(blob)
    corpus = open_text_corpus(
        str(tmp_path / "bad.jsonl.zst"), index_dir=tmp_path / "i", retries=3, backoff=2.0
    )
    began = time.monotonic()
    with pytest.raises(CorpusFormatError, match="bad.jsonl.zst"):
        corpus.plan(progress=False)
    assert time.monotonic() - began < 2.0  # damage is not retried


@pytest.mark.parametrize("keys", [{"text_key": "body"}, {"columns": ["missing"]}])
def test_a_parquet_column_that_is_not_there_is_refused_by_name_even_when_planned(
    tmp_path, corpus_dir, keys
):
    """pyarrow reads a row group without the columns it lacks: a wrong text_key (once the
    object's plan is in the index, which does not depend on it) or a wrong column gave
    documents without them."""
    src, _ = corpus_dir
    open_text_corpus(str(src / "a.parquet"), index_dir=tmp_path / "i").plan(progress=False)
    corpus = open_text_corpus(str(src / "a.parquet"), index_dir=tmp_path / "i", **keys)
    corpus.plan(progress=False)
    wrong = keys.get("text_key") or keys["columns"][0]
    with pytest.raises(CorpusFormatError, match=rf"a.parquet has no column '{wrong}'"):
        list(corpus.dataset(shuffle=False))


def test_a_folder_without_corpus_files_says_what_was_searched(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match=r"1 objects searched for \.parquet"):
        open_text_corpus(str(tmp_path), index_dir=tmp_path / "i").plan(progress=False)


def test_a_parquet_corpus_refuses_a_cache(tmp_path, corpus_dir):
    src, _ = corpus_dir
    corpus = open_text_corpus(str(src), index_dir=tmp_path / "i")
    with pytest.raises(ValueError, match="ranged row-group reads"):
        corpus.dataset(cache=PrefetchCache(tmp_path / "cache", max_bytes=2**30))


class BusyHandler(FaultInjectingHandler):
    """Answers 429 with `Retry-After` to the first `busy_first` requests of each path."""

    def _busy(self) -> bool:
        fixture = self.server.fixture
        rel = self.path.lstrip("/")
        with fixture.lock:
            fixture.times[rel].append(time.monotonic())
            busy = len(fixture.times[rel]) <= fixture.busy_first
        if busy:
            self.send_response(429, "Too Many Requests")
            self.send_header("Retry-After", f"{fixture.retry_after:g}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        return busy

    def do_HEAD(self):
        if not self._busy():
            super().do_HEAD()

    def do_GET(self):
        if not self._busy():
            super().do_GET()


class BusyServer(LocalHTTPServer):
    """`LocalHTTPServer` whose first `busy_first` requests of each path answer 429 with
    `Retry-After: retry_after`; `times[path]` holds each request's `time.monotonic()`."""

    def __init__(self, root, *, busy_first: int, retry_after: float):
        super().__init__(root)
        self.busy_first = busy_first
        self.retry_after = retry_after
        self.times = defaultdict(list)

    def __enter__(self) -> BusyServer:
        self._server = _FixtureHTTPServer(self)
        self._server.RequestHandlerClass = BusyHandler
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self


def test_http_with_429_and_retry_after_honoured(tmp_path, corpus_dir):
    """Each object's first two requests (fsspec's HEAD, then its GET fallback) answer 429 with
    Retry-After: 0.3; the retry waits that long (the backoff alone would be 0.01 s), and every
    document still comes once."""
    src, _ = corpus_dir
    with BusyServer(src, busy_first=2, retry_after=0.3) as server:
        urls = [server.url(name) for name in ("a.parquet", "b.jsonl", "c.jsonl.gz")]
        corpus = open_text_corpus(urls, index_dir=tmp_path / "index", backoff=0.01)
        corpus.plan(progress=False)
        for times in server.times.values():
            assert times[2] - times[1] >= 0.3
        seen = documents(corpus, ranks=2, workers=0)
        assert set(seen.values()) == {1} and len(seen) == 240


def test_jsonl_over_http_through_the_cache_is_downloaded_once_per_node(tmp_path, corpus_dir):
    src, _ = corpus_dir
    with LocalHTTPServer(src) as server:
        urls = [server.url("b.jsonl"), server.url("c.jsonl.gz")]
        corpus = open_text_corpus(urls, index_dir=tmp_path / "index").plan(progress=False)
        planned = sum(server.gets.values())
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30)
        for epoch in range(2):
            seen = documents(corpus, ranks=2, workers=2, epoch=epoch, cache=cache)
            assert set(seen.values()) == {1} and len(seen) == 160
        assert sum(server.gets.values()) - planned == 2  # one download per object


@pytest.mark.slow  # moto's server: in the full suite (CI)
def test_a_corpus_on_s3(tmp_path, corpus_dir, monkeypatch):
    import s3fs

    src, _ = corpus_dir
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with MotoS3Server() as server:
        server.client().create_bucket(Bucket="bucket")
        options = server.storage_options()
        fs = s3fs.S3FileSystem(**options)
        for name in os.listdir(src):
            fs.put(str(src / name), f"bucket/corpus/{name}")
        corpus = open_text_corpus(
            "s3://bucket/corpus", storage_options=options, index_dir=tmp_path / "index"
        ).plan(progress=False)
        assert corpus.urls == [f"s3://bucket/corpus/{n}" for n in sorted(os.listdir(src))]
        seen = documents(corpus, ranks=2, workers=2)
        assert set(seen.values()) == {1} and len(seen) == 240
        write = fs.open("bucket/corpus/b.jsonl", "wb")
        with write:
            write.write(b'{"text": "rewritten"}\n')
        with pytest.raises(CorpusChangedError, match="s3://bucket/corpus/b.jsonl"):
            documents(corpus, ranks=1, workers=0)


def test_a_state_saved_before_an_object_was_rewritten_is_refused_on_resume(tmp_path, corpus_dir):
    """The same row count, other content: the objects' versions are part of the plan's
    settings, so a resume refuses the state instead of going on in other documents."""
    src, parts = corpus_dir
    corpus = open_text_corpus(str(src), index_dir=tmp_path / "index").plan(progress=False)
    loader = make_loader(corpus.dataset(seed=3), batch_size=8, num_workers=0)
    iterator = iter(loader)
    next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    write_jsonl(src / "b.jsonl", [t + " (edited)" for t in parts["b.jsonl"]])
    os.utime(src / "b.jsonl", ns=(1, 1))  # a new version even where mtimes are coarse
    again = open_text_corpus(str(src), index_dir=tmp_path / "index").plan(progress=False)
    assert again.lengths.tolist() == corpus.lengths.tolist()
    resumed = make_loader(again.dataset(seed=3), batch_size=8, num_workers=0)
    with pytest.raises(ValueError, match="shard_versions"):
        resumed.load_state_dict(state)
