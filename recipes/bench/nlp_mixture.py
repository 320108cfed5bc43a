"""`recipes bench nlp --mix`: one token cache against two mixed by `MixtureSources`, and a
scheduled token mixture against fixed weights (issue 48).

Use when: checking what a mixture costs over one source, what a `Schedule` over tokens costs
over fixed weights, and how big the state grows.
Cost: builds two token caches (the corpus's halves) in a temporary folder; one epoch per loader
and repetition.
Adapt here: the weights (0.5 / 0.5), `PHASES` (the schedule).
Trade-off: the mixture's draw is measured with the loader; its state size over 1,000,000
samples is computed apart (`mix_state_sizes`). The schedule's cost is a whole epoch's time per
batch, its plan's draw included (a median, not a best: the draw is part of every epoch).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from recipes.bench.harness.bench_charts import Chart, write_chart
from recipes.bench.harness.measure import best_interleaved, measure
from recipes.common import (
    LengthBucketSampler,
    MixtureSampler,
    MixtureSources,
    Schedule,
    make_loader,
)
from recipes.nlp import PadCollate, build_token_cache


def compare_mix(
    texts,
    tokenizer,
    folder: Path,
    *,
    max_length: int,
    max_tokens: int,
    pad_to_multiple_of: int,
    repeat: int = 5,
):
    """One source (a token cache of every text, bucketed) against the same texts as two token
    caches (the halves) mixed 0.5 / 0.5 then bucketed (`MixtureSources` + `MixtureSampler` +
    `LengthBucketSampler(mixture=)`), epochs of the same length through make_loader; returns
    the two rows and the plan's draw time per epoch (a one-off per epoch, inside the mixed rows)."""
    import numpy as np

    half = len(texts) // 2
    whole = build_token_cache(
        texts, tokenizer, folder / "all", max_length=max_length, progress=False
    )
    parts = [
        build_token_cache(
            texts[:half], tokenizer, folder / "a", max_length=max_length, progress=False
        ),
        build_token_cache(
            texts[half:], tokenizer, folder / "b", max_length=max_length, progress=False
        ),
    ]
    sources = MixtureSources(parts)
    lengths = np.concatenate([np.asarray(p.lengths) for p in parts])
    collate = PadCollate(0, pad_to_multiple_of=pad_to_multiple_of)

    def single():
        sampler = LengthBucketSampler(
            np.asarray(whole.lengths),
            max_tokens=max_tokens,
            pad_to_multiple_of=pad_to_multiple_of,
            seed=1,
        )
        return make_loader(whole, batch_sampler=sampler, collate_fn=collate, num_workers=0)

    def mixed():
        mix = MixtureSampler(
            {"first half": len(parts[0]), "second half": len(parts[1])},
            {"first half": 0.5, "second half": 0.5},
            num_samples=len(texts),
            stop="never",
            seed=2,
            num_replicas=1,
            rank=0,
        )
        sampler = LengthBucketSampler(
            lengths,
            max_tokens=max_tokens,
            pad_to_multiple_of=pad_to_multiple_of,
            seed=1,
            mixture=mix,
        )
        return make_loader(sources, batch_sampler=sampler, collate_fn=collate, num_workers=0), mix

    count = _real_tokens
    rows = best_interleaved(
        lambda: measure("one source: LengthBucketSampler", single(), counter=count),
        lambda: measure(
            "two sources: MixtureSampler + LengthBucketSampler(mixture=)", mixed()[0], counter=count
        ),
        repeat=repeat,
    )
    mix = mixed()[1]
    start = time.perf_counter()
    for epoch in range(5):
        mix.global_indices(epoch + 100)
    draw = (time.perf_counter() - start) / 5
    return rows, draw


# A 3-phase schedule over tokens (fractions of the run: the epochs measured), two sources.
PHASES = (
    (0.0, {"first half": 0.8, "second half": 0.2}),
    (0.4, {"first half": 0.5, "second half": 0.5}),
    (0.8, {"first half": 0.2, "second half": 0.8}),
)


class EpochCost(NamedTuple):
    """A loader's median time per batch over whole epochs (its plan's draw included)."""

    name: str
    batch_ms: float
    cpu_ms: float  # this process's CPU time per batch (median)
    batches: int
    tokens_per_batch: float  # real tokens: a schedule over tokens may draw longer samples
    draw_ms: float  # the plan's draw alone, per epoch


def compare_schedule(parts, *, batch_size: int, pad_to_multiple_of: int, repeat: int = 7):
    """Fixed weights 0.5 / 0.5 (in samples, no lengths) against `PHASES` over tokens (with each
    sample's length), both `MixtureSampler(batch_size=)` over the same two token caches through
    make_loader, epochs of the same number of samples, taken in turns; each repetition a new
    epoch (a new plan). Returns the two `EpochCost`s."""
    import numpy as np

    sources = MixtureSources(parts)
    sizes = {"first half": len(parts[0]), "second half": len(parts[1])}
    lengths = {name: np.asarray(p.lengths) for name, p in zip(sizes, parts, strict=True)}
    samples = sum(sizes.values())
    tokens = int(sum(x.sum() for x in lengths.values()))
    collate = PadCollate(0, pad_to_multiple_of=pad_to_multiple_of)
    settings = {"stop": "never", "num_samples": samples, "seed": 3, "batch_size": batch_size}
    fixed = MixtureSampler(sizes, {"first half": 0.5, "second half": 0.5}, **settings)
    schedule = Schedule(PHASES, over="tokens", total=repeat * tokens)
    scheduled = MixtureSampler(sizes, schedule, lengths=lengths, **settings)
    loaders = [
        make_loader(sources, batch_sampler=mix, collate_fn=collate, num_workers=0)
        for mix in (fixed, scheduled)
    ]
    times = [[], []]
    cpu_times = [[], []]  # this process's CPU: less moved by other processes on a busy machine
    real = [0, 0]
    batches = [0, 0]
    for epoch in range(repeat):
        for number, (mix, loader) in enumerate(zip((fixed, scheduled), loaders, strict=True)):
            mix.set_epoch(epoch)
            count = 0
            start = time.perf_counter()
            cpu = time.process_time()
            for batch in loader:
                count += 1
                real[number] += _real_tokens(batch)
            times[number].append((time.perf_counter() - start) / count)
            cpu_times[number].append((time.process_time() - cpu) / count)
            batches[number] += count
    draws = [_draw_ms(mix, repeat) for mix in (fixed, scheduled)]
    names = ("fixed weights 0.5 / 0.5 (samples)", "Schedule: 3 phases over tokens, lengths=")
    return [
        EpochCost(
            names[i],
            statistics.median(times[i]) * 1e3,
            statistics.median(cpu_times[i]) * 1e3,
            batches[i] // repeat,
            real[i] / batches[i],
            draws[i],
        )
        for i in range(2)
    ]


def _draw_ms(mix: MixtureSampler, epochs: int) -> float:
    """The plan's draw per epoch (ms), for epochs after those measured."""
    start = time.perf_counter()
    for epoch in range(epochs, 2 * epochs):
        mix.set_epoch(epoch)
        mix.global_indices()
    return (time.perf_counter() - start) / epochs * 1e3


def _real_tokens(batch) -> int:
    return int(batch["lengths"].sum())


def mix_state_sizes(samples: int = 1_000_000, batch: int = 1000) -> tuple[int, int]:
    """The loader state's JSON size after one batch and after `samples` samples of a mixture
    over two sources (a trivial dataset: the loop's cost is the sampler's and the loader's)."""
    import json

    import torch
    from torch.utils.data import ConcatDataset, Dataset

    class Ints(Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, index):
            return index

        def __getitems__(self, indices):
            return indices

    sizes = [samples // 2, 3 * samples]
    mix = MixtureSampler(sizes, [0.5, 0.5], num_samples=samples, stop="never", seed=0)
    loader = make_loader(
        ConcatDataset([Ints(n) for n in sizes]),
        batch_size=batch,
        sampler=mix,
        num_workers=0,
        collate_fn=torch.tensor,
    )
    iterator = iter(loader)
    next(iterator)
    first = len(json.dumps(loader.state_dict()))
    for _ in iterator:
        pass
    return first, len(json.dumps(loader.state_dict()))


def run_mix(args, texts, tokenizer, workers) -> int:
    with tempfile.TemporaryDirectory(prefix="recipes-bench-mix-") as tmp:
        rows, draw = compare_mix(
            list(texts),
            tokenizer,
            Path(tmp),
            max_length=args.max_length,
            max_tokens=args.max_tokens,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )

        parts = [
            build_token_cache(
                texts[: len(texts) // 2],
                tokenizer,
                Path(tmp) / "a",
                max_length=args.max_length,
                progress=False,
            ),
            build_token_cache(
                texts[len(texts) // 2 :],
                tokenizer,
                Path(tmp) / "b",
                max_length=args.max_length,
                progress=False,
            ),
        ]  # the caches compare_mix built: reused
        costs = compare_schedule(
            parts, batch_size=args.batch_size, pad_to_multiple_of=args.pad_to_multiple_of
        )

    single, mixed = rows
    heading = (
        f"nlp mixture: {len(texts):,} texts as one token cache and as two (the halves, "
        f"MixtureSources) mixed 0.5 / 0.5, max_tokens {args.max_tokens}, make_loader (no workers: "
        "the sampler's cost is in the loop)"
    )
    print(f"\n## {heading}\n")
    print("| loader | real tokens/s | vs one source | first batch (s) |\n|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.name} | {row.items_per_s:,.0f} | {row.items_per_s / single.items_per_s:.3f}x "
            f"| {row.first_batch_seconds:.3f} |"
        )
    write_chart(
        Chart(
            "nlp-mixture",
            heading,
            "real tokens/s",
            tuple(r.name for r in rows),
            tuple(r.items_per_s for r in rows),
            ratio_format="{:.3f}x",
        ),
        getattr(args, "plot", None),
    )
    epoch_seconds = single.seconds
    print(
        f"\nmixing overhead: {1 - mixed.items_per_s / single.items_per_s:+.2%} of the loader's "
        f"rate; the epoch's plan draw {draw * 1000:.1f} ms per epoch ({draw / epoch_seconds:.2%} "
        "of one source's epoch time)"
    )
    _print_schedule(costs, args.batch_size)
    first, last = mix_state_sizes()
    print(
        f"loader state (JSON) after 1 batch: {first:,} bytes; after 1,000,000 samples: {last:,} "
        "bytes"
    )
    return 0


def _print_schedule(costs: list[EpochCost], batch_size: int) -> None:
    fixed, scheduled = costs
    print(  # the epochs span the schedule's phases
        f"\n## nlp mixture schedule: the same two sources, batches of {batch_size}, make_loader "
        "(no workers), whole epochs (the plan's draw included), median of 7\n"
    )
    print(
        "| loader | ms per batch | vs fixed | CPU ms per batch | vs fixed | batches per epoch | "
        "real tokens per batch | plan draw (ms/epoch) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for cost in costs:
        print(
            f"| {cost.name} | {cost.batch_ms:.3f} | {cost.batch_ms / fixed.batch_ms:.3f}x | "
            f"{cost.cpu_ms:.3f} | {cost.cpu_ms / fixed.cpu_ms:.3f}x | {cost.batches:,} | "
            f"{cost.tokens_per_batch:,.0f} | {cost.draw_ms:.1f} |"
        )
    print(
        f"\ncost per batch of a scheduled token mixture over fixed weights: "
        f"{scheduled.batch_ms / fixed.batch_ms - 1:+.2%} of wall time, "
        f"{scheduled.cpu_ms / fixed.cpu_ms - 1:+.2%} of CPU time (issue 48's target: under 5%)"
    )
