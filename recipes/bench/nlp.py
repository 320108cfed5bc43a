"""`recipes bench nlp`: tokenize-in-__getitem__ + random batches against the token-cache recipe.

Use when: checking what cached tokenization and length bucketing buy on your corpus
(`--texts corpus.txt --tokenizer saved_tokenizer_dir`).
Cost: generates a long-tailed corpus and trains a small BPE tokenizer on the fly (default),
builds the cache once, then one epoch per loader with the same DataLoader settings.
Adapt here: `--max-tokens` (the recipe's padded-token budget), `--batch-size` (the baseline's).
Trade-off: the recipe's batches hold a varying number of samples (about `--max-tokens` padded
tokens each); the comparison is real (non-padding) tokens per second.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader

from recipes.bench.harness.bench_charts import chart_of_rows, write_chart
from recipes.bench.harness.measure import best_interleaved, measure
from recipes.bench.harness.train_setup import TrainSetup
from recipes.bench.harness.workers import chosen_workers, worker_init_for, workers_override
from recipes.bench.nlp_mixture import run_mix
from recipes.bench.nlp_pack import run_pack
from recipes.common import (
    LengthBucketSampler,
    ThreadLoader,
    make_loader,
)
from recipes.nlp import PadCollate, build_token_cache
from recipes.nlp.texts import TextSource
from recipes.testing import make_text_corpus, train_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--texts", default=None, help=".txt or .jsonl corpus (default: generated)")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="saved tokenizer folder (default: trained)"
    )
    parser.add_argument(
        "--samples", type=int, default=20000, help="generated samples (default data only)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="the baseline's batch size")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=8192,
        help="the recipe's padded tokens per batch (default: about the padded size of the "
        "baseline's random batches of 32 on the default corpus, so both use the same memory)",
    )
    parser.add_argument(
        "--pad-to-multiple-of", type=int, default=8, help="the recipe's padding multiple"
    )
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: smart_num_workers)"
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help=(
            "compare sequence packing with bucketing, flattening and random padded batches instead"
        ),
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="--pack: T, tokens per row")
    parser.add_argument("--rows", type=int, default=8, help="--pack: B, rows per packed batch")
    parser.add_argument(
        "--mix",
        action="store_true",
        help="the overhead of a MixtureSampler over two sources against one source, and the "
        "loader state's size after 1 and after 1,000,000 samples",
    )


class _Tokenizing:
    """The baseline: tokenize each text in `__getitem__`."""

    def __init__(self, texts, tokenizer, max_length):
        self.texts = texts
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int):
        return self.tokenizer(self.texts[index], truncation=True, max_length=self.max_length)


class _TokenCounter:
    """Counts real and padded tokens of `{"input_ids", "attention_mask"}` batches."""

    def __init__(self):
        self.real = 0
        self.padded = 0
        self.batches = 0

    def __call__(self, batch) -> int:
        self.batches += 1
        real = int(batch["attention_mask"].sum())
        self.real += real
        self.padded += batch["attention_mask"].numel()
        return real

    @property
    def waste(self) -> float:
        return (self.padded - self.real) / self.padded if self.padded else 0.0


def _inputs(args):
    if args.texts is not None:
        texts = [t for batch in TextSource(args.texts).batches(10_000) for t in batch]
    else:
        texts = make_text_corpus(args.samples, seed=0)
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    else:
        tokenizer = train_tokenizer(texts[:5000], vocab_size=8000)
    return texts, tokenizer


def compare(
    texts,
    tokenizer,
    *,
    batch_size=32,
    max_tokens=8192,
    max_length=512,
    workers=1,
    pad_to_multiple_of=8,
    repeat: int = 3,
):
    """Encode rates, then (rows, counters) for the baseline and the recipe: each loader's best of
    `repeat` epochs, taken in turns (an epoch lasts 0.1-1.5 s)."""
    from transformers import DataCollatorWithPadding
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    start = time.perf_counter()
    tokenizer(texts, truncation=True, max_length=max_length, return_attention_mask=False)
    own_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="recipes-bench-tokens-") as folder:
        start = time.perf_counter()
        cache = build_token_cache(
            texts, tokenizer, Path(folder) / "cache", max_length=max_length, progress=False
        )
        build_seconds = time.perf_counter() - start
        common = dict(
            num_workers=workers, pin_memory=False, worker_init_fn=worker_init_for(workers)
        )
        baseline = DataLoader(
            _Tokenizing(texts, tokenizer, max_length),
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            collate_fn=DataCollatorWithPadding(tokenizer),
            **common,
        )
        sampler = LengthBucketSampler(
            cache.lengths, max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of, seed=0
        )
        collate = PadCollate(tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
        recipe = DataLoader(cache, batch_sampler=sampler, collate_fn=collate, **common)
        threads = ThreadLoader(
            cache,
            batch_sampler=LengthBucketSampler(
                cache.lengths, max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of, seed=0
            ),
            collate_fn=collate,
        )
        lengths = cache.lengths
        loaders = (
            ("tokenize in __getitem__ + random batches (baseline)", baseline),
            ("TokenCache + LengthBucketSampler + PadCollate, DataLoader workers", recipe),
            (
                "TokenCache + LengthBucketSampler + PadCollate, threads (make_loader's path)",
                threads,
            ),
        )
        counters = [
            _TokenCounter() for _ in loaders
        ]  # the first epoch's (every epoch holds the same tokens)
        counted = set()

        def once(k: int):
            name, loader = loaders[k]
            counter = counters[k]
            if k in counted:  # only the first epoch's tokens are counted
                counter = _TokenCounter()
            counted.add(k)
            return measure(name, loader, counter=counter)

        with (
            warnings.catch_warnings()
        ):  # the samplers' epoch is read again on purpose: the same batches each turn
            warnings.simplefilter("ignore")
            rows = best_interleaved(
                *(functools.partial(once, k) for k in range(len(loaders))), repeat=repeat
            )
    m = pad_to_multiple_of
    rounding = float(((-(-lengths // m) * m) - lengths).sum())
    rates = {
        "own_seconds": own_seconds,
        "build_seconds": build_seconds,
        "texts": len(texts),
        "rounding_waste": rounding / counters[1].padded if counters[1].padded else 0.0,
    }
    return rates, rows, counters


def run(args: argparse.Namespace) -> int:
    texts, tokenizer = _inputs(args)
    workers = chosen_workers(args.workers)
    if args.pack:
        return run_pack(args, texts, tokenizer, workers)
    if args.mix:
        return run_mix(args, texts, tokenizer, workers)
    rates, rows, counters = compare(
        texts,
        tokenizer,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        max_length=args.max_length,
        workers=workers,
        pad_to_multiple_of=args.pad_to_multiple_of,
    )
    base = rows[0].items_per_s
    heading = (
        f"nlp: {len(texts):,} texts, max_length {args.max_length}, baseline batch "
        f"{args.batch_size}, recipe max_tokens {args.max_tokens}, {workers} workers"
    )
    print(f"\n## {heading}\n")
    print(
        "| loader | real tokens/s | vs baseline | padding waste | padded tokens/batch | first "
        "batch (s) | peak memory (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row, counter in zip(rows, counters, strict=True):
        print(
            f"| {row.name} | {row.items_per_s:,.0f} | {row.items_per_s / base:.2f}x | "
            f"{counter.waste:.1%} | {counter.padded / max(counter.batches, 1):,.0f} | "
            f"{row.first_batch_seconds:.2f} | {row.peak_bytes / 2**20:,.0f} |"
        )
    write_chart(
        chart_of_rows("nlp", heading, rows, unit="real tokens/s"), getattr(args, "plot", None)
    )
    print(
        f"\nOf the recipe's padding, {rates['rounding_waste']:.1%} of all padded tokens is the "
        f"rounding of each sample to a multiple of {args.pad_to_multiple_of} (tensor-core "
        "alignment), the rest is bucketing."
    )
    own = rates["texts"] / rates["own_seconds"]
    built = rates["texts"] / rates["build_seconds"]
    print(
        f"\ncache build: {built:,.0f} texts/s (hashing, tokenizing, writing) vs the tokenizer's "
        f"own batch encode {own:,.0f} texts/s = {built / own:.0%}"
    )
    return 0


# ---- `recipes bench train --domain nlp` ----------------------------------------------------
class TrainDefaults(NamedTuple):
    """What `recipes bench train --domain nlp` uses where its arguments are left out."""

    batch: int
    samples: int  # texts generated
    model: str


# by whether the device is CUDA: a real model on the GPU, a tiny one that a CPU run can afford
DEFAULTS = {True: TrainDefaults(128, 50_000, "bert-small"), False: TrainDefaults(16, 2_000, "tiny")}


def train_setup(args, device):
    """A BERT masked-LM from a `BertConfig` (no weights; small on CUDA, tiny on CPU), fed by
    tokenize-in-__getitem__ random batches and by TokenCache + LengthBucketSampler + PadCollate.
    Counted in real (non-padding) tokens."""
    from transformers import DataCollatorWithPadding
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = device.type == "cuda"
    defaults = DEFAULTS[cuda]
    batch = args.batch_size or defaults.batch
    texts = make_text_corpus(args.samples or defaults.samples, seed=0)
    tokenizer = train_tokenizer(texts[:5000], vocab_size=8000)
    model_name = args.model or defaults.model
    step = _mlm_step(model_name, len(tokenizer), tokenizer.mask_token_id, device)
    workers = chosen_workers(args.workers)
    folder = tempfile.mkdtemp(prefix="recipes-train-bench-tokens-")
    start = time.perf_counter()
    cache = build_token_cache(texts, tokenizer, folder, max_length=512, progress=False)
    build = time.perf_counter() - start
    plain = DataLoader(
        _Tokenizing(texts, tokenizer, 512),
        batch_size=batch,
        shuffle=True,
        collate_fn=DataCollatorWithPadding(tokenizer),
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=worker_init_for(workers),
    )
    sampler = LengthBucketSampler(cache.lengths, max_tokens=batch * 256, seed=0)
    overrides = workers_override(args.workers)
    recipe = make_loader(
        cache, batch_sampler=sampler, collate_fn=PadCollate(tokenizer.pad_token_id), **overrides
    )

    def to_device(b):
        return {k: b[k].to(device, non_blocking=True) for k in ("input_ids", "attention_mask")}

    resident = to_device(
        next(
            iter(
                DataLoader(
                    cache, batch_sampler=sampler, collate_fn=PadCollate(tokenizer.pad_token_id)
                )
            )
        )
    )
    notes = [
        f"{len(texts):,} generated texts, baseline batch {batch}, recipe max_tokens {batch * 256}; "
        f"token cache built in {build:.1f} s (one-off). The recipe reads the cache only, so it has "
        "no separate cold row."
    ]
    return TrainSetup(
        "tokens",
        step,
        lambda b: int(b["attention_mask"].sum()),
        resident,
        [
            ("tokenize in __getitem__ + random batches (plain)", plain, to_device),
            ("TokenCache + LengthBucketSampler + PadCollate, make_loader", recipe, to_device),
        ],
        model_name,
        notes,
    )


def _mlm_step(name: str, vocab: int, mask_id: int, device):
    from transformers import BertConfig, BertForMaskedLM

    sizes = {
        "bert-small": dict(
            hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048
        ),
        "tiny": dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
        ),
    }
    if name not in sizes:
        raise ValueError(f"`--model` for nlp must be bert-small or tiny, but is {name!r} instead.")
    model = BertForMaskedLM(
        BertConfig(vocab_size=vocab, max_position_embeddings=512, **sizes[name])
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device).manual_seed(0)
    autocast = device.type == "cuda"

    def step(batch):
        ids = batch["input_ids"]
        mask = batch["attention_mask"]
        chosen = (
            torch.rand(ids.shape, device=ids.device, generator=generator) < 0.15
        ) & mask.bool()
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(
                input_ids=torch.where(chosen, torch.full_like(ids, mask_id), ids),
                attention_mask=mask,
                labels=labels,
            ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
