"""A tiny `recipes bench text-stream`: its four tables print, every loader sees the corpus's
tokens, and the 429 storm loses nothing."""

import pytest

pytest.importorskip("datasets")
pytest.importorskip("huggingface_hub")
pytest.importorskip("pyarrow")

from recipes.bench.text_stream import hub_reads  # noqa: E402
from recipes.bench.text_stream.throughput import compare_throughput  # noqa: E402
from recipes.cli import main  # noqa: E402

TINY = dict(documents=400, files=4, median_words=40, seq_len=256, rows=4, workers=1)


@pytest.mark.slow  # a tiny bench run, about 6 s: in the full suite (CI)
def test_every_loader_reads_the_corpus_and_the_storm_loses_nothing(tmp_path):
    rows, facts = compare_throughput(tmp_path, **TINY)
    streamed, hf, cache = rows
    assert streamed.items == cache.items == facts["tokens"]
    # the concat-and-cut packer drops each worker's last partial row, no more
    assert facts["tokens"] - TINY["seq_len"] <= hf.items <= facts["tokens"]
    loader = dict(seq_len=256, rows=4, workers=1)
    clean, stormy = hub_reads.storm(
        tmp_path, tmp_path / "corpus", facts["tokenizer"], storm=2, retry_after=1, **loader
    )
    assert clean["tokens"] == stormy["tokens"] == facts["tokens"]
    assert stormy["throttled"] == 2 and stormy["seconds"] >= 1.0  # Retry-After honoured


@pytest.mark.slow  # 15 s: two servers, four epochs over the fake Hub
def test_bench_text_stream_prints_its_tables(capsys):
    argv = ["bench", "text-stream", "--documents", "400", "--files", "4", "--median-words", "40"]
    argv += ["--seq-len", "256", "--rows", "4", "--storm", "2", "--repeat", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "streamed / token cache:" in out and "streamed / datasets streaming:" in out
    for heading in ("first batch", "fake Hub requests per object", "a 429 storm"):
        assert f"## text-stream: {heading}" in out, out
    assert "| fake Hub (hf://) |" in out and "| moto S3 (s3://) |" in out
