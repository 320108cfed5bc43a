"""`recipes bench text-stream`: the streamed tokenize-and-pack path against `datasets` streaming
and a token cache; its first batch from the Hub and S3, requests per node, and a 429 storm.

Use when: choosing between tokenizing on the fly (`open_text_corpus` + `PackedTextStream`) and a
token cache, and sizing the requests a pretraining job sends to the Hub or a bucket.
Cost: a long-tailed Parquet corpus (`--documents`, `--files`) and a BPE tokenizer made in a temp
folder; a token cache built once; one epoch per loader (`throughput.py`), then the fake Hub and
moto's S3 on 127.0.0.1 with `--latency` per request (`hub_reads.py`): a minute on 2 cores at
the defaults.
Adapt here: `--seq-len`, `--rows`, `--workers`; `--storm` and `--retry-after`.
Trade-off: one run, every row side by side on the same cores; the remote rows share them with
their servers, and nodes are simulated in one process.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from recipes.bench.harness.measure import format_table
from recipes.bench.text_stream import hub_reads
from recipes.bench.text_stream.throughput import compare_throughput

TARGET_CACHE = 0.70
TARGET_HF = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=40_000, help="texts (default 40,000)")
    parser.add_argument("--files", type=int, default=8, help="Parquet files (default 8)")
    parser.add_argument("--median-words", type=int, default=120, help="words per text (median)")
    parser.add_argument("--seq-len", type=int, default=2048, help="T, tokens per row")
    parser.add_argument("--rows", type=int, default=8, help="B, rows per batch")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument(
        "--repeat", type=int, default=2, help="epochs per loader, taken in turns (best kept)"
    )
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request")
    parser.add_argument("--storm", type=int, default=8, help="requests answered 429 (default 8)")
    parser.add_argument("--retry-after", type=int, default=1, help="a 429's Retry-After (s)")
    parser.add_argument(
        "--local-only", action="store_true", help="only the throughput table (no Hub, no S3)"
    )


def show_throughput(args: argparse.Namespace, rows, facts: dict) -> None:
    print(
        f"\n## text-stream: {facts['documents']:,} documents ({facts['tokens']:,} tokens) in "
        f"{args.files} Parquet files, T={args.seq_len}, B={args.rows}, {args.workers} workers\n"
    )
    print(format_table(rows, unit="tokens/s", whole_epoch=True))
    streamed, hf, cache = (row.items_per_s for row in rows)
    cache_first_epoch = facts["tokens"] / (facts["build_seconds"] + rows[2].seconds)
    print(
        f"\nstreamed / token cache: {streamed / cache:.2f} (target >= {TARGET_CACHE:.2f}); "
        f"streamed / datasets streaming: {streamed / hf:.2f}x (target >= {TARGET_HF:g}x)"
    )
    print(
        f"tokenizer alone, one process: {facts['encode_per_s']:,.0f} tokens/s; token cache "
        f"build {facts['build_seconds']:.2f} s, so its first epoch (build + read) runs at "
        f"{cache_first_epoch:,.0f} tokens/s"
    )


def show_remote(args: argparse.Namespace, first: dict, nodes: dict, storm: list[dict]) -> None:
    print(f"\n## text-stream: first batch, {args.latency * 1000:.0f} ms per request, cold index\n")
    print("| source | plan (s) | first batch (s) | whole epoch (s) | tokens/s, whole epoch |")
    print("|---|---:|---:|---:|---:|")
    for name, row in first.items():
        print(
            f"| {name} | {row['plan']:.2f} | {row['first']:.2f} | {row['seconds']:.2f} | "
            f"{row['tokens'] / row['seconds']:,.0f} |"
        )
    ranks = len(nodes["per_node"])
    print(f"\n## text-stream: fake Hub requests per object, {ranks} nodes x 2 ranks, one epoch\n")
    print("| node | resolve GETs per object (min / mean / max) | HEADs | requests in all |")
    print("|---|---:|---:|---:|")
    for node, counts in enumerate(nodes["per_node"]):
        gets = [counts["gets"].get(key, 0) for key in sorted(counts["gets"])]
        gets += [0] * (nodes["objects"] - len(gets))
        print(
            f"| {node} | {min(gets)} / {sum(gets) / len(gets):.1f} / {max(gets)} | "
            f"{sum(counts['heads'].values())} | {counts['requests']} |"
        )
    print(f"\n## text-stream: a 429 storm (Retry-After {args.retry_after} s), fake Hub\n")
    print("| epoch | seconds | tokens | tokens/s | 429s served |")
    print("|---|---:|---:|---:|---:|")
    for row in storm:
        print(
            f"| {row['name']} | {row['seconds']:.2f} | {row['tokens']:,} | "
            f"{row['tokens'] / row['seconds']:,.0f} | {row['throttled']} |"
        )


def run(args: argparse.Namespace) -> int:
    loader = dict(seq_len=args.seq_len, rows=args.rows, workers=args.workers)
    with tempfile.TemporaryDirectory(prefix="recipes-bench-text-stream-") as tmp:
        folder = Path(tmp)
        rows, facts = compare_throughput(
            folder,
            documents=args.documents,
            files=args.files,
            median_words=args.median_words,
            repeat=args.repeat,
            **loader,
        )
        show_throughput(args, rows, facts)
        if args.local_only:
            return 0
        tokenizer = facts["tokenizer"]
        corpus = folder / "corpus"
        first = hub_reads.first_batches(folder, corpus, tokenizer, latency=args.latency, **loader)
        nodes = hub_reads.requests_per_node(folder, corpus, tokenizer, seq_len=args.seq_len)
        storm = hub_reads.storm(
            folder, corpus, tokenizer, storm=args.storm, retry_after=args.retry_after, **loader
        )
        show_remote(args, first, nodes, storm)
    return 0
