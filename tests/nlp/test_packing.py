"""Sequence packing: exactly-once coverage, boundaries, static shapes, DDP, resume, and a
tiny causal transformer that gives the same logits packed as alone."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes.nlp import (
    PackCollate,
    PackedBatchSampler,
    build_token_cache,
    document_attention_mask,
    packed_loader,
)


@pytest.fixture(scope="module")
def cache(corpus, tokenizer, tmp_path_factory):
    return build_token_cache(corpus, tokenizer, tmp_path_factory.mktemp("pack"), progress=False)


def _pieces_of(sampler, batches):
    """(document, start, length) of every piece in `batches` (lists of keys), with its batch
    and row."""
    p = sampler.num_pieces
    out = []
    for k, batch in enumerate(batches):
        rows, pieces = np.divmod(np.asarray(batch, dtype=np.int64), p)
        for r, piece in zip(rows.tolist(), pieces.tolist(), strict=True):
            out.append(
                (
                    int(sampler.piece_doc[piece]),
                    int(sampler.piece_start[piece]),
                    int(sampler.piece_len[piece]),
                    k,
                    r,
                )
            )
    return out


def _documents_from_batch(batch):
    """Every document of a packed batch, cut at position_ids == 0 and read up to the padding
    (an independent decoding of the layout)."""
    docs = []
    for r in range(batch["input_ids"].shape[0]):
        ids, pos, labels = batch["input_ids"][r], batch["position_ids"][r], batch["labels"][r]
        used = int(batch["seq_lens"][r].sum())
        starts = [i for i in range(used) if pos[i] == 0] + [used]
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b].tolist() == list(range(b - a))
            assert labels[a] == -100 and labels[a + 1 : b].tolist() == ids[a + 1 : b].tolist()
            docs.append(ids[a:b].tolist())
        assert (labels[used:] == -100).all()
    return docs


def test_every_token_once_in_static_batches_equal_to_the_cache(cache):
    loader = packed_loader(cache, seq_len=64, batch_size=4, num_workers=0, seed=3)
    got, shapes, real = [], set(), 0
    for batch in loader:
        shapes.add(tuple(batch["input_ids"].shape))
        got.extend(_documents_from_batch(batch))
        real += int(batch["num_tokens"])
    assert shapes == {(4, 64)}
    expected = []
    for i in range(len(cache)):
        ids = cache[i]["input_ids"].tolist()
        expected.extend(
            ids[s : s + 64] for s in range(0, len(ids), 64)
        )  # long documents: 64-token pieces
    assert sorted(got) == sorted(expected)
    assert real == int(cache.lengths.sum())


def test_seq_lens_and_cu_seqlens_describe_the_rows(cache):
    batch = next(iter(packed_loader(cache, seq_len=64, batch_size=3, num_workers=0)))
    b, t = batch["input_ids"].shape
    d = batch["seq_lens"].shape[1]
    assert batch["seq_lens"].dtype == torch.int32 and batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].shape == (b * (d + 1) + 1,)
    cu = batch["cu_seqlens"].tolist()
    for r in range(b):
        lens = [x for x in batch["seq_lens"][r].tolist() if x]
        starts = [i for i in range(t) if batch["position_ids"][r, i] == 0 and i < sum(lens)]
        assert [y - x for x, y in zip(starts, starts[1:] + [sum(lens)], strict=False)] == lens
        assert cu[(r + 1) * (d + 1)] == (r + 1) * t  # every row ends at a multiple of T


def test_workers_give_the_same_batches(cache):
    plain = [
        b["input_ids"]
        for b in packed_loader(cache, seq_len=64, batch_size=4, num_workers=0, seed=1)
    ]
    forked = [
        b["input_ids"]
        for b in packed_loader(cache, seq_len=64, batch_size=4, num_workers=2, seed=1)
    ]
    assert len(plain) == len(forked) and all(
        torch.equal(a, b) for a, b in zip(plain, forked, strict=False)
    )


def test_epochs_differ_and_repeat_from_the_seed(cache):
    def first(seed, epoch):
        loader = packed_loader(cache, seq_len=64, batch_size=4, num_workers=0, seed=seed)
        loader.batch_sampler.set_epoch(epoch)
        return next(iter(loader))["input_ids"]

    assert torch.equal(first(0, 1), first(0, 1))
    assert not torch.equal(first(0, 0), first(0, 1))


def test_long_documents_split_or_refused():
    lengths = [10, 300, 5]
    sampler = PackedBatchSampler(lengths, seq_len=128, batch_size=2, shuffle=False)
    assert sorted(
        zip(
            sampler.piece_doc.tolist(),
            sampler.piece_start.tolist(),
            sampler.piece_len.tolist(),
            strict=False,
        )
    ) == [(0, 0, 10), (1, 0, 128), (1, 128, 128), (1, 256, 44), (2, 0, 5)]
    with pytest.raises(ValueError, match=r"document 1 has 300 tokens.*split_long=True"):
        PackedBatchSampler(lengths, seq_len=128, batch_size=2, split_long=False)


def test_resume_through_the_loader_state(cache):
    loader = packed_loader(cache, seq_len=64, batch_size=2, num_workers=0, seed=5)
    full = [b["input_ids"] for b in loader]
    loader = packed_loader(cache, seq_len=64, batch_size=2, num_workers=0, seed=5)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    resumed = packed_loader(cache, seq_len=64, batch_size=2, num_workers=0, seed=5)
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for b in resumed]
    assert len(rest) == len(full) - 3 and all(
        torch.equal(a, b) for a, b in zip(rest, full[3:], strict=False)
    )
    other = packed_loader(cache, seq_len=128, batch_size=2, num_workers=0, seed=5)
    with pytest.raises(ValueError, match=r"seq_len=64 \(saved\) vs 128.*same data and settings"):
        other.batch_sampler.load_state_dict(state["sampler"])


def test_collate_rejects_overfull_rows():
    items = [
        {"input_ids": torch.ones(40, dtype=torch.int64), "row": 0},
        {"input_ids": torch.ones(30, dtype=torch.int64), "row": 0},
    ]
    with pytest.raises(ValueError, match="row 0 holds 70 tokens"):
        PackCollate(64, 2)(items)


# ---- properties ------------------------------------------------------------------------------
lengths_st = st.lists(st.integers(0, 300), min_size=1, max_size=120)


@settings(max_examples=30, deadline=None)
@given(
    lengths=lengths_st,
    seq_len=st.sampled_from([16, 64, 128]),
    batch_size=st.integers(1, 5),
    window=st.integers(1, 8),
    seed=st.integers(0, 3),
)
def test_pieces_cover_every_token_exactly_once_and_fit_their_rows(
    lengths, seq_len, batch_size, window, seed
):
    sampler = PackedBatchSampler(
        lengths, seq_len=seq_len, batch_size=batch_size, window=window, seed=seed
    )
    pieces = _pieces_of(sampler, list(sampler))
    covered = {}
    for doc, start, length, _, _ in pieces:
        covered.setdefault(doc, []).append((start, length))
    for doc, n in enumerate(lengths):
        spans = sorted(covered.get(doc, []))
        assert sum(length for _, length in spans) == n  # every token, once
        assert [s for s, _ in spans] == list(range(0, n, seq_len))[
            : len(spans)
        ]  # contiguous pieces
        assert len(spans) == (math.ceil(n / seq_len) if n else 0)  # split only when longer than T
    rows = {}
    for _, _, length, k, r in pieces:
        rows[(k, r)] = rows.get((k, r), 0) + length
        assert r < batch_size
    assert max(rows.values(), default=0) <= seq_len


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, world=st.integers(2, 4), drop_last=st.booleans(), seed=st.integers(0, 3))
def test_ranks_get_equal_counts_and_are_disjoint_apart_from_bounded_padding(
    lengths, world, drop_last, seed
):
    samplers = [
        PackedBatchSampler(
            lengths,
            seq_len=64,
            batch_size=2,
            num_replicas=world,
            rank=r,
            seed=seed,
            drop_last=drop_last,
        )
        for r in range(world)
    ]
    plans = [list(s) for s in samplers]
    assert len({len(p) for p in plans}) == 1
    total = len(samplers[0].global_batches())
    seen = [tuple(b) for p in plans for b in p]
    repeated = len(seen) - len(set(seen))
    assert repeated <= world - 1
    assert len(set(seen)) == (total - total % world if drop_last else total)


@settings(max_examples=40, deadline=None)
@given(
    lengths=lengths_st,
    before=st.integers(1, 3),
    after=st.integers(1, 3),
    stop=st.integers(0, 6),
    seed=st.integers(0, 3),
)
def test_resume_is_the_uninterrupted_rest_on_any_number_of_ranks(
    lengths, before, after, stop, seed
):
    kwargs = dict(seq_len=64, batch_size=2, seed=seed)
    first = [
        PackedBatchSampler(lengths, num_replicas=before, rank=r, **kwargs) for r in range(before)
    ]
    steps = min(stop, len(first[0]))
    for s in first:
        it = iter(s)
        for _ in range(steps):
            next(it)
    state = first[0].state_dict()
    done = [
        tuple(b)
        for r in range(before)
        for b in list(PackedBatchSampler(lengths, num_replicas=before, rank=r, **kwargs))[:steps]
    ]
    second = [
        PackedBatchSampler(lengths, num_replicas=after, rank=r, **kwargs) for r in range(after)
    ]
    for s in second:
        s.load_state_dict(json.loads(json.dumps(state)))
    rest = [tuple(b) for s in second for b in s]
    plan = [tuple(b) for b in PackedBatchSampler(lengths, **kwargs).global_batches()]
    # the module's padding rule: each pass repeats the epoch's first batches up to a multiple of
    # its ranks; the first pass's repeats are taken only when its ranks ran past the plan
    taken = steps * before
    left = max(len(plan) - taken, 0)
    repeats = taken - len(plan) if taken > len(plan) else (-left) % after
    extra = [plan[i % len(plan)] for i in range(repeats)] if plan else []
    assert len({len(list(s)) for s in second}) == 1  # equal counts on the new ranks
    assert Counter(done + rest) == Counter(
        plan + extra
    )  # every batch once, repeats only as padding


# ---- a tiny causal transformer: packed logits equal each document alone ----------------------
class TinyCausalLM(torch.nn.Module):
    def __init__(self, vocab=700, dim=32, heads=4, layers=2, max_len=128):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "qkv": torch.nn.Linear(dim, 3 * dim),
                    "out": torch.nn.Linear(dim, dim),
                    "norm1": torch.nn.LayerNorm(dim),
                    "norm2": torch.nn.LayerNorm(dim),
                    "mlp": torch.nn.Sequential(
                        torch.nn.Linear(dim, 4 * dim),
                        torch.nn.GELU(),
                        torch.nn.Linear(4 * dim, dim),
                    ),
                }
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, mask):
        x = self.embed(input_ids) + self.pos(position_ids)
        b, t, d = x.shape
        for block in self.blocks:
            q, k, v = (
                block["qkv"](block["norm1"](x))
                .view(b, t, 3, self.heads, d // self.heads)
                .permute(2, 0, 3, 1, 4)
            )
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + block["out"](attn.transpose(1, 2).reshape(b, t, d))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x)


def test_packed_logits_equal_each_document_alone(cache):
    torch.manual_seed(0)
    model = TinyCausalLM(
        vocab=int(
            max(int(cache[i]["input_ids"].max()) for i in range(len(cache)) if cache.lengths[i])
        )
        + 1
    )
    model.eval()
    batch = next(iter(packed_loader(cache, seq_len=128, batch_size=3, num_workers=0, seed=2)))
    with torch.no_grad():
        packed = model(
            batch["input_ids"],
            batch["position_ids"],
            document_attention_mask(batch["position_ids"]),
        )
        checked = 0
        for r in range(batch["input_ids"].shape[0]):
            start = 0
            for length in [x for x in batch["seq_lens"][r].tolist() if x]:
                ids = batch["input_ids"][r : r + 1, start : start + length]
                alone = model(
                    ids,
                    torch.arange(length)[None],
                    torch.ones(length, length, dtype=torch.bool).tril(),
                )
                torch.testing.assert_close(
                    packed[r : r + 1, start : start + length], alone, atol=1e-5, rtol=1e-4
                )
                start += length
                checked += 1
    assert checked > 3
    # without the mask, documents after the first in a row do see their neighbours
    with torch.no_grad():
        leaky = model(
            batch["input_ids"], batch["position_ids"], torch.ones(128, 128, dtype=torch.bool).tril()
        )
    assert not torch.allclose(leaky, packed, atol=1e-3)


def test_block_mask_matches_the_dense_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from recipes.nlp import document_block_mask

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0] * 13 + [0, 1]])
    try:
        block = document_block_mask(position_ids)
    except Exception as error:  # noqa: BLE001 - CPU support for create_block_mask varies by torch version
        pytest.skip(f"FlexAttention block masks unavailable on CPU here: {error}")
    dense = document_attention_mask(position_ids)[0, 0]
    t = position_ids.shape[1]
    q, kv = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    got = block.mask_mod(torch.zeros_like(q), torch.zeros_like(q), q, kv)
    assert torch.equal(got, dense)
