"""Tokens per second of the streamed tokenize-and-pack path beside Hugging Face streaming and
beside a token cache, over one local Parquet corpus.

Use when: deciding whether to tokenize on the fly (`open_text_corpus` + `PackedTextStream`) or
to build a token cache first, and checking what the stream costs against `datasets` streaming.
Cost: a long-tailed corpus written as Parquet files (`write_corpus`), a BPE tokenizer trained
on it, a token cache built once (timed apart), then one epoch per loader, all with the same
worker count, rows of `seq_len` and batches of `rows`.
Adapt here: `write_corpus`'s sizes; `hf_packed_loader` is the simplest fair packer (concatenate
every document's tokens, cut every `seq_len`).
Trade-off: the HF packer yields `input_ids` only, where ours also lays out labels, positions and
document boundaries: the comparison favours it slightly. The token cache reads no text: it is
the ceiling when the corpus can be tokenized once.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from recipes.bench.harness.measure import Measurement, best_interleaved, measure
from recipes.bench.harness.workers import worker_init_for
from recipes.common import open_text_corpus
from recipes.common.loading.loader import make_loader
from recipes.nlp import PackedTextStream, build_token_cache, packed_loader
from recipes.testing import make_text_corpus, train_tokenizer


def write_corpus(folder: Path, *, documents: int, files: int, median_words: int) -> list[Path]:
    """`documents` long-tailed texts as `files` Parquet files of row groups of 128 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    texts = make_text_corpus(documents, median_words=median_words, seed=0)
    paths = []
    for f, part in enumerate(np.array_split(np.arange(documents), files)):
        path = folder / f"part-{f:04d}.parquet"
        pq.write_table(pa.table({"text": [texts[i] for i in part]}), path, row_group_size=128)
        paths.append(path)
    return paths


def count_tokens(batch) -> int:
    """Real tokens of a batch: `num_tokens` of our layout, every slot of a plain `[B, T]`."""
    if isinstance(batch, dict) and "num_tokens" in batch:
        return int(batch["num_tokens"].sum())
    return int(batch.numel())


class HFPacked(IterableDataset):
    """Rows of `seq_len` tokens over a `datasets` stream that was mapped to `input_ids`:
    concatenate, cut every `seq_len` (the last partial row of each worker dropped)."""

    def __init__(self, stream, seq_len: int):
        self.stream = stream
        self.seq_len = seq_len

    def __iter__(self):
        buffer: list[int] = []
        for example in self.stream:  # `datasets` deals its files over the DataLoader's workers
            buffer.extend(example["input_ids"])
            while len(buffer) >= self.seq_len:
                yield torch.tensor(buffer[: self.seq_len])
                del buffer[: self.seq_len]


def hf_packed_loader(paths: list[Path], tokenizer, *, seq_len: int, rows: int, workers: int):
    """`load_dataset("parquet", streaming=True)` + `.map(tokenize, batched=True)` + `HFPacked`,
    through a DataLoader of `workers` workers."""
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"])["input_ids"]}

    stream = load_dataset(
        "parquet", data_files=[str(p) for p in paths], split="train", streaming=True
    )
    stream = stream.map(tokenize, batched=True, remove_columns=["text"])
    return DataLoader(
        HFPacked(stream, seq_len),
        batch_size=rows,
        num_workers=workers,
        worker_init_fn=worker_init_for(workers),
    )


def streamed_loader(folder: Path, index: Path, tokenizer, *, seq_len: int, rows: int, workers):
    """`open_text_corpus` over the Parquet folder, packed on the fly by `PackedTextStream`."""
    corpus = open_text_corpus(str(folder), index_dir=index).plan(progress=False)
    documents = corpus.dataset(seed=0, rank=0, world_size=1)
    stream = PackedTextStream(documents, tokenizer, seq_len=seq_len, id_key=("file", "row"))
    return make_loader(
        stream, batch_size=rows, collate_fn=stream.collate(rows), num_workers=workers
    )


def encode_rate(folder: Path, tokenizer, *, batch: int = 64) -> float:
    """Tokens per second of the tokenizer alone, in this process, in batches of `batch`
    documents (the stream's `tokenize_batch`): what bounds the stream per core."""
    import pyarrow.parquet as pq

    texts = []
    for path in sorted(folder.glob("*.parquet")):
        texts.extend(pq.read_table(path, columns=["text"]).column("text").to_pylist())
    tokens = 0
    began = time.perf_counter()
    for start in range(0, len(texts), batch):
        encoded = tokenizer(texts[start : start + batch])["input_ids"]
        tokens += sum(len(ids) for ids in encoded)
    return tokens / (time.perf_counter() - began)


def compare_throughput(
    folder: Path,
    *,
    documents: int = 20_000,
    files: int = 8,
    median_words: int = 120,
    seq_len: int = 2048,
    rows: int = 8,
    workers: int = 2,
    repeat: int = 1,
) -> tuple[list[Measurement], dict]:
    """Rows: streamed (ours), HF streaming + map + packing, token cache + `packed_loader`, each
    the best of `repeat` epochs taken in turns (the index warm after the first); and facts:
    tokens in the corpus, the tokenizer alone, the tokenizer's training and the cache's build
    seconds, the tokenizer."""
    paths = write_corpus(
        folder / "corpus", documents=documents, files=files, median_words=median_words
    )
    began = time.perf_counter()
    tokenizer = train_tokenizer(make_text_corpus(2000, median_words=median_words), vocab_size=8000)
    trained = time.perf_counter() - began
    began = time.perf_counter()
    cache = build_token_cache(
        str(folder / "corpus"), tokenizer, folder / "cache", max_length=None, progress=False
    )
    built = time.perf_counter() - began
    common = dict(seq_len=seq_len, rows=rows, workers=workers)

    def streamed():
        built = streamed_loader(folder / "corpus", folder / "index", tokenizer, **common)
        name = f"open_text_corpus + PackedTextStream, {workers} workers"
        return measure(name, built, counter=count_tokens)

    def hf():
        built = hf_packed_loader(paths, tokenizer, **common)
        name = f"datasets streaming + map(tokenize) + concat-and-cut, {workers} workers"
        return measure(name, built, counter=count_tokens)

    def cached():
        built = packed_loader(
            cache, seq_len=seq_len, batch_size=rows, pad_id=tokenizer.pad_token_id, **loader
        )
        name = f"build_token_cache + packed_loader (ceiling), {workers} workers"
        return measure(name, built, counter=count_tokens)

    loader = dict(num_workers=workers)
    results = best_interleaved(streamed, hf, cached, repeat=repeat)
    facts = {
        "tokens": int(cache.lengths.sum()),
        "encode_per_s": encode_rate(folder / "corpus", tokenizer),
        "documents": documents,
        "train_seconds": trained,
        "build_seconds": built,
        "tokenizer": tokenizer,
    }
    return results, facts
