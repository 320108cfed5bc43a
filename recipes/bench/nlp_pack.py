"""`recipes bench nlp --pack`: padded batches against packed rows (`PackedBatchSampler`).

Use when: checking what packing buys over padding on your corpus: real tokens per second, the
fill of each batch (real tokens over slots), and the number of batch shapes per epoch.
Cost: the corpus and tokenizer of `recipes bench nlp`; one epoch per loader.
Adapt here: `--seq-len` (T) and `--rows` (B) of the packed batches.
Trade-off: packed rows hold several texts each (attention across them is the model's to mask).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from recipes.bench.harness.bench_charts import chart_of_rows, write_chart
from recipes.bench.harness.measure import measure
from recipes.bench.harness.workers import worker_init_for
from recipes.common import LengthBucketSampler
from recipes.nlp import PadCollate, build_token_cache, packed_loader


class _AsLists:
    """Cache items as `{"input_ids": list}`, the input `DataCollatorWithFlattening` expects."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int):
        return {"input_ids": self.cache[index]["input_ids"].tolist()}


class _ShapeCounter:
    """Real tokens, slots and distinct `input_ids` shapes of any of the compared batch layouts."""

    def __init__(self):
        self.real = self.slots = self.batches = 0
        self.shapes: set[tuple[int, ...]] = set()

    def __call__(self, batch) -> int:
        ids = batch["input_ids"]
        if "num_tokens" in batch:
            real = int(batch["num_tokens"])
        elif "attention_mask" in batch:
            real = int(batch["attention_mask"].sum())
        else:  # flattened: every slot is a token
            real = ids.numel()
        self.real += real
        self.slots += ids.numel()
        self.batches += 1
        self.shapes.add(tuple(ids.shape))
        return real

    @property
    def fill(self) -> float:
        return self.real / self.slots if self.slots else 0.0


def compare_pack(
    texts, tokenizer, *, seq_len=2048, rows=8, batch_size=32, max_length=512, workers=1
):
    """Packing against bucketing, flattening and random padded batches, all from one token cache
    with the same DataLoader settings; every layout gets about `rows * seq_len` token slots
    per batch (random batches: `batch_size` samples). Returns [(Measurement, _ShapeCounter)]."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    common = dict(num_workers=workers, pin_memory=False, worker_init_fn=worker_init_for(workers))
    out = []
    with tempfile.TemporaryDirectory(prefix="recipes-bench-pack-") as folder:
        cache = build_token_cache(
            texts, tokenizer, Path(folder) / "cache", max_length=max_length, progress=False
        )
        mean = float(cache.lengths.mean())
        per_batch = max(1, round(rows * seq_len / mean))
        shuffled = dict(shuffle=True, generator=torch.Generator().manual_seed(0))
        loaders = [
            (
                f"random batches of {batch_size} + DataCollatorWithPadding (baseline)",
                DataLoader(
                    _AsLists(cache),
                    batch_size=batch_size,
                    collate_fn=DataCollatorWithPadding(tokenizer),
                    **shuffled,
                    **common,
                ),
            ),
            (
                f"LengthBucketSampler(max_tokens={rows * seq_len}) + PadCollate",
                DataLoader(
                    cache,
                    batch_sampler=LengthBucketSampler(
                        cache.lengths, max_tokens=rows * seq_len, pad_to_multiple_of=8, seed=0
                    ),
                    collate_fn=PadCollate(tokenizer.pad_token_id),
                    **common,
                ),
            ),
            (
                f"DataCollatorWithFlattening, random batches of {per_batch} (one row each)",
                DataLoader(
                    _AsLists(cache),
                    batch_size=per_batch,
                    collate_fn=DataCollatorWithFlattening(),
                    **shuffled,
                    **common,
                ),
            ),
            (
                f"packed_loader(seq_len={seq_len}, batch_size={rows})",
                packed_loader(
                    cache, seq_len=seq_len, batch_size=rows, pad_id=tokenizer.pad_token_id, **common
                ),
            ),
        ]
        for name, loader in loaders:
            counter = _ShapeCounter()
            out.append((measure(name, loader, counter=counter), counter))
    return out


def run_pack(args, texts, tokenizer, workers) -> int:
    results = compare_pack(
        texts,
        tokenizer,
        seq_len=args.seq_len,
        rows=args.rows,
        batch_size=args.batch_size,
        max_length=args.max_length,
        workers=workers,
    )

    base = results[0][0].items_per_s
    heading = (
        f"nlp packing: {len(texts):,} texts, max_length {args.max_length}, T={args.seq_len}, "
        f"B={args.rows}, {workers} workers"
    )
    print(f"\n## {heading}\n")
    print(
        "| loader | real tokens/s | vs baseline | fill (real / slots) | batch shapes per epoch | "
        "first batch (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row, counter in results:
        print(
            f"| {row.name} | {row.items_per_s:,.0f} | {row.items_per_s / base:.2f}x | "
            f"{counter.fill:.1%} | {len(counter.shapes):,} | {row.first_batch_seconds:.2f} |"
        )
    write_chart(
        chart_of_rows("nlp-packing", heading, [row for row, _ in results], unit="real tokens/s"),
        getattr(args, "plot", None),
    )
    return 0
