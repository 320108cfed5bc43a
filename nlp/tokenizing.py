"""The tokenizer as a token cache sees it: its fingerprint, and a batch encoder equal to a call.

Use when: a cache of tokens must know whether a tokenizer would give the same tokens as the one
that built it (`tokenizer_fingerprint`), or tokenize many texts fast (`batch_encoder`).
Cost: the fingerprint serialises the tokenizer once (its `tokenizer.json`, or its vocabulary
for a slow one) and hashes it; the encoder copies a fast tokenizer once, then calls its Rust
batch encoder per batch.
Adapt here: `tokenizer_fingerprint` (what decides a tokenizer's output) for a tokenizer
that keeps state elsewhere.
Trade-off: the fingerprint hashes the tokenizer's full content, never a random or name-based
key, so a changed tokenizer always rebuilds, and an equal one saved elsewhere is reused.
Copy with: nothing.
"""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> dict:
    """Everything that decides a tokenizer's output, as JSON-able data (never random)."""
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    info = {
        "class": type(tokenizer).__name__,
        "special_tokens": special,
        "added_tokens": sorted((str(t), int(i)) for t, i in tokenizer.get_added_vocab().items()),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: its tokenizer.json (model, normalizer, ...)
        config = json.loads(backend.to_str())
        # Calling the tokenizer with truncation= or padding= leaves that runtime state in the
        # backend; the build sets its own, so it must not change the key (issue #10).
        config.pop("truncation", None)
        config.pop("padding", None)
        info["tokenizer_json"] = hashlib.sha256(
            json.dumps(config, sort_keys=True).encode("utf-8")
        ).hexdigest()
    else:
        vocab = sorted(tokenizer.get_vocab().items())
        info["vocab"] = hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest()
        info["init_kwargs"] = {
            k: v
            for k, v in sorted(tokenizer.init_kwargs.items())
            if isinstance(v, (str, int, float, bool, type(None)))
        }
    return info


def batch_encoder(tokenizer, *, max_length: int | None, add_special_tokens: bool):
    """`encode(list[str]) -> list[list[int]]`, equal to `tokenizer(texts, truncation=...,
    max_length=...)["input_ids"]`. For fast tokenizers it calls the Rust batch encoder of a
    copy configured for truncation (what `transformers` does inside, minus its conversions)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:

        def encode_slow(texts):
            return tokenizer(
                texts,
                add_special_tokens=add_special_tokens,
                truncation=max_length is not None,
                max_length=max_length,
                return_attention_mask=False,
                return_token_type_ids=False,
            )["input_ids"]

        return encode_slow
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_padding()
    if max_length is None:
        copy.no_truncation()
    else:
        copy.enable_truncation(max_length, direction=getattr(tokenizer, "truncation_side", "right"))

    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we do not store.
    encode_batch = getattr(copy, "encode_batch_fast", copy.encode_batch)

    def encode_fast(texts):
        return [e.ids for e in encode_batch(texts, add_special_tokens=add_special_tokens)]

    return encode_fast
