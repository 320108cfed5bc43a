"""The streamed text path read where corpora live: the first batch from the fake Hub and from
S3, requests per object per node over an epoch, and a 429 storm's cost.

Use when: sizing a pretraining job that reads Parquet from the Hugging Face Hub or a bucket:
how long a job waits for its first batch (listing, footers and the first row groups included),
how many requests each node sends per object, and what a rate limit with `Retry-After` costs.
Cost: the Parquet corpus of `throughput.py` served by the fake Hub (`recipes.testing_hub`) and
by moto's S3 (`recipes.testing_servers`), with `latency` per request; one epoch per row.
Adapt here: `latency`, the storm's size (`storm`) and its `Retry-After` (`retry_after`).
Trade-off: nodes are simulated in one process (each rank's dataset read in turn with its own
index folder); loopback has no bandwidth cap, so the rates are the reader's, not a network's.
"""

from __future__ import annotations

import collections
import shutil
import time
from pathlib import Path

from recipes.bench.text_stream.throughput import count_tokens
from recipes.common import open_text_corpus
from recipes.common.loading.loader import make_loader
from recipes.nlp import PackedTextStream
from recipes.testing_hub import LocalHub, hub_process, use_hub_endpoint
from recipes.testing_hub_answers import HubRoute
from recipes.testing_servers import s3_store_process

REPO = "owner/corpus"
BUCKET = "recipes-bench-text"


def hub_root(folder: Path, corpus: Path) -> Path:
    """A fake Hub folder holding `corpus`'s Parquet files as `owner/corpus/data/*.parquet`."""
    root = folder / "hub"
    data = root / REPO / "data"
    data.mkdir(parents=True, exist_ok=True)
    for path in sorted(corpus.glob("*.parquet")):
        shutil.copyfile(path, data / path.name)
    return root


def _loader(url: str, index: Path, tokenizer, *, seq_len, rows, workers, options=None, rank=0):
    corpus = open_text_corpus(url, index_dir=index, storage_options=options)
    documents = corpus.plan(progress=False).dataset(seed=0, rank=rank, world_size=1)
    stream = PackedTextStream(documents, tokenizer, seq_len=seq_len, id_key=("file", "row"))
    return make_loader(
        stream, batch_size=rows, collate_fn=stream.collate(rows), num_workers=workers
    )


def first_batch(url: str, index: Path, tokenizer, *, options=None, **loader) -> dict:
    """Seconds to plan the corpus (cold index) and to the first batch from the open on, and the
    epoch's tokens per second (first batch included)."""
    began = time.perf_counter()
    built = _loader(url, index, tokenizer, options=options, **loader)
    planned = time.perf_counter() - began
    tokens = 0
    first = 0.0
    for batch in built:
        tokens += count_tokens(batch)
        if not first:
            first = time.perf_counter() - began
    seconds = time.perf_counter() - began
    return {"plan": planned, "first": first, "seconds": seconds, "tokens": tokens}


def first_batches(folder: Path, corpus: Path, tokenizer, *, latency: float, **loader) -> dict:
    """`first_batch` from the fake Hub (in a process of its own) and from moto's S3."""
    root = hub_root(folder, corpus)
    out = {}
    with hub_process(root, latency=latency) as endpoint, use_hub_endpoint(endpoint):
        url = f"hf://datasets/{REPO}/data"
        out["fake Hub (hf://)"] = first_batch(url, folder / "index-hub", tokenizer, **loader)
    names = sorted(p.name for p in corpus.glob("*.parquet"))
    with s3_store_process(corpus, names, bucket=BUCKET, latency=latency) as options:
        url = f"s3://{BUCKET}/"
        out["moto S3 (s3://)"] = first_batch(
            url, folder / "index-s3", tokenizer, options=options, **loader
        )
    return out


def _rank_tokens(url: str, index: Path, tokenizer, *, rank: int, world_size: int, seq_len: int):
    corpus = open_text_corpus(url, index_dir=index).plan(progress=False)
    documents = corpus.dataset(seed=0, rank=rank, world_size=world_size, even=False)
    stream = PackedTextStream(documents, tokenizer, seq_len=seq_len, id_key=("file", "row"))
    return sum(sum(row["seq_lens"]) for row in stream)


def requests_per_node(
    folder: Path, corpus: Path, tokenizer, *, nodes: int = 2, ranks: int = 2, seq_len: int
) -> dict:
    """One epoch over `nodes` x `ranks` from an in-process fake Hub, each node with its own index
    folder (its local disk): the resolve requests (GETs, HEADs) per object per node, and the
    bytes of the objects."""
    root = hub_root(folder, corpus)
    per_node = []
    tokens = 0
    with LocalHub(root) as hub, use_hub_endpoint(hub.endpoint):
        url = f"hf://datasets/{REPO}/data"
        for node in range(nodes):
            gets = collections.Counter(hub.gets)
            heads = collections.Counter(hub.heads)
            others = len(hub.log)
            for local in range(ranks):
                tokens += _rank_tokens(
                    url,
                    folder / f"index-node{node}",
                    tokenizer,
                    rank=node * ranks + local,
                    world_size=nodes * ranks,
                    seq_len=seq_len,
                )
            per_node.append(
                {
                    "gets": hub.gets - gets,
                    "heads": hub.heads - heads,
                    "requests": len(hub.log) - others,
                }
            )
        api = sum(1 for r in hub.log if r.route is not HubRoute.RESOLVE)
    objects = len(list(corpus.glob("*.parquet")))
    return {"per_node": per_node, "objects": objects, "tokens": tokens, "api": api}


def storm(
    folder: Path, corpus: Path, tokenizer, *, storm: int, retry_after: int, **loader
) -> list[dict]:
    """One epoch from an in-process fake Hub, clean then with the next `storm` requests after
    the plan answered 429 with `Retry-After: retry_after`: seconds, tokens, 429s served."""
    root = hub_root(folder, corpus)
    out = []
    with LocalHub(root, retry_after=retry_after) as hub, use_hub_endpoint(hub.endpoint):
        url = f"hf://datasets/{REPO}/data"
        for name, limit in (("clean", 0), (f"429 storm ({storm} requests)", storm)):
            built = _loader(url, folder / f"index-storm-{limit}", tokenizer, **loader)
            throttled = sum(hub.throttled.values())
            hub.limit_next = limit
            began = time.perf_counter()
            tokens = sum(count_tokens(batch) for batch in built)
            seconds = time.perf_counter() - began
            out.append(
                {
                    "name": name,
                    "seconds": seconds,
                    "tokens": tokens,
                    "throttled": sum(hub.throttled.values()) - throttled,
                }
            )
    return out
