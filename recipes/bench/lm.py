"""`recipes bench train --domain lm`: a small causal LM fed bucketed padded batches and packed
batches from the same token cache, in real (non-padding) tokens per second.

Use when: deciding between `LengthBucketSampler` + `PadCollate` and `packed_loader` for a
decoder: packing fills every `[B, T]` slot with real tokens and keeps one shape, bucketing
needs no document mask.
Cost: trains a BPE tokenizer and builds a token cache of `--samples` generated texts, then
`--steps` steps per loader. The model is a GPT-style decoder written here (learned positions,
SDPA with a boolean mask), so both layouts run through the same attention kernel.
Adapt here: `_SIZES` for the model, `--batch-size` (rows B) and the `T` below.
Trade-off: with a dense `[B, 1, T, T]` mask SDPA cannot use FlashAttention; a varlen kernel
fed `cu_seqlens` (or FlexAttention's block mask) would skip the masked blocks and favour
packing further.
"""

from __future__ import annotations

import tempfile
import time
from typing import NamedTuple

import torch

from recipes.bench.harness.train_setup import TrainSetup
from recipes.bench.harness.workers import workers_override
from recipes.common import LengthBucketSampler, make_loader
from recipes.nlp import PadCollate, build_token_cache, document_attention_mask, packed_loader
from recipes.testing import make_text_corpus, train_tokenizer

_SIZES = {"gpt-small": dict(dim=512, layers=6, heads=8), "tiny": dict(dim=64, layers=2, heads=2)}


class TrainDefaults(NamedTuple):
    """What `recipes bench train --domain lm` uses where its arguments are left out."""

    rows: int  # B
    seq_len: int  # T
    samples: int  # texts generated
    model: str


# by whether the device is CUDA: a real model on the GPU, a tiny one that a CPU run can afford
DEFAULTS = {
    True: TrainDefaults(8, 2048, 50_000, "gpt-small"),
    False: TrainDefaults(4, 256, 2_000, "tiny"),
}


def train_setup(args, device):
    cuda = device.type == "cuda"
    defaults = DEFAULTS[cuda]
    rows = args.batch_size or defaults.rows
    seq_len = defaults.seq_len
    texts = make_text_corpus(args.samples or defaults.samples, seed=0)
    tokenizer = train_tokenizer(texts[:5000], vocab_size=8000)
    model_name = defaults.model
    if args.model in _SIZES:
        model_name = args.model
    step = _lm_step(model_name, len(tokenizer), seq_len, device)
    folder = tempfile.mkdtemp(prefix="recipes-train-bench-lm-")
    start = time.perf_counter()
    cache = build_token_cache(texts, tokenizer, folder, max_length=seq_len, progress=False)
    build = time.perf_counter() - start
    overrides = workers_override(args.workers)
    sampler = LengthBucketSampler(
        cache.lengths, max_tokens=rows * seq_len, pad_to_multiple_of=8, seed=0
    )
    bucketed = make_loader(
        cache,
        batch_sampler=sampler,
        collate_fn=PadCollate(tokenizer.pad_token_id, return_labels=True),
        **overrides,
    )
    packed = packed_loader(
        cache, seq_len=seq_len, batch_size=rows, pad_id=tokenizer.pad_token_id, **overrides
    )

    def padded_to_device(b):
        ids = b["input_ids"].to(device, non_blocking=True)
        real = b["attention_mask"].to(device, non_blocking=True)
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return {
            "input_ids": ids,
            "position_ids": torch.arange(t, device=device).expand_as(ids),
            "mask": causal & real.bool()[:, None, None, :],
            "labels": b["labels"].to(device, non_blocking=True),
            "real": int(b["lengths"].sum()),
        }

    def packed_to_device(b):
        position_ids = b["position_ids"].to(device, non_blocking=True)
        return {
            "input_ids": b["input_ids"].to(device, non_blocking=True),
            "position_ids": position_ids,
            "mask": document_attention_mask(position_ids),
            "labels": b["labels"].to(device, non_blocking=True),
            "real": int(b["num_tokens"]),
        }

    resident = packed_to_device(
        next(iter(packed_loader(cache, seq_len=seq_len, batch_size=rows, num_workers=0)))
    )
    notes = [
        f"{len(texts):,} generated texts, T={seq_len}, B={rows} (bucketing: max_tokens "
        f"{rows * seq_len}); token cache built in {build:.1f} s (one-off). Rates count real tokens "
        "only."
    ]
    return TrainSetup(
        "tokens",
        step,
        lambda b: b["real"],
        resident,
        [
            (
                "TokenCache + LengthBucketSampler + PadCollate (bucketed padding)",
                bucketed,
                padded_to_device,
            ),
            (f"packed_loader (T={seq_len}, document mask)", packed, packed_to_device),
        ],
        model_name,
        notes,
    )


def _lm_step(name: str, vocab: int, max_len: int, device):
    import torch
    import torch.nn.functional as F

    size = _SIZES[name]
    dim = size["dim"]
    heads = size["heads"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(dim)
            self.norm2 = torch.nn.LayerNorm(dim)
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.out = torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
            )

        def forward(self, x, mask):
            b, t, _ = x.shape
            q, k, v = (
                self.qkv(self.norm1(x)).view(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            )
            x = x + self.out(
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                .transpose(1, 2)
                .reshape(b, t, dim)
            )
            return x + self.mlp(self.norm2(x))

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.pos = torch.nn.Embedding(max_len, dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(size["layers"]))
            self.head = torch.nn.Linear(dim, vocab)

        def forward(self, ids, position_ids, mask):
            x = self.embed(ids) + self.pos(position_ids)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(x)

    model = Decoder().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = device.type == "cuda"

    def step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(batch["input_ids"], batch["position_ids"], batch["mask"])
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten()
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
