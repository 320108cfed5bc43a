"""PackedTextStream (issue 49, points 2 and 3): documents tokenized on the fly and packed into
rows of exactly seq_len tokens. Over an epoch on 2 ranks x 2 workers, the rows rebuilt into
documents equal the tokenizer applied to each document (none altered at a row boundary); an
epoch stopped at a random batch and resumed on another shape from rank 0's state (as JSON)
gives every token once over both runs, from a state under 4 KB; a resume on the same shape goes
on exactly; the carry logic holds for rows of any length over documents of any lengths."""

from __future__ import annotations

import collections
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes.common import (
    LoaderMonitor,
    MixtureIterable,
    ShardedIterableDataset,
    StatefulLoader,
    make_loader,
)
from recipes.nlp.streaming.packed_text_stream import PackedTextStream, packed_text_loader
from recipes.nlp.streaming.row_packing import TokenizedPart, pack_rows

SIZES = [23, 17, 30, 12, 25, 19]  # documents per JSONL shard
SEQ_LEN = 48
BATCH = 3


def _read(path, start, stop):
    with open(path) as f:
        lines = f.read().splitlines()
    return [json.loads(line) for line in lines[start:stop]]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, corpus):
    folder = tmp_path_factory.mktemp("jsonl")
    paths = []
    doc = 0
    texts = [t for t in corpus if t.strip()] * 2
    for k, size in enumerate(SIZES):
        lines = []
        for _ in range(size):
            lines.append(json.dumps({"id": doc, "text": texts[doc % len(texts)]}))
            doc += 1
        path = Path(folder) / f"part-{k}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def expected(shards, tokenizer):
    """Each document's tokens, the tokenizer applied to it directly."""
    docs = [d for path in shards for d in _read(path, 0, None)]
    ids = tokenizer([d["text"] for d in docs])["input_ids"]
    return {d["id"]: list(tokens) for d, tokens in zip(docs, ids, strict=True)}


def _documents(shards, rank=0, world=1):
    return ShardedIterableDataset(
        shards,
        _read,
        shard_lengths=SIZES,
        rank=rank,
        world_size=world,
        split="samples",
        even=False,
        seed=5,
    )


def _stream(shards, tokenizer, rank=0, world=1):
    return PackedTextStream(
        _documents(shards, rank, world), tokenizer, seq_len=SEQ_LEN, tokenize_batch=8
    )


def _loader(shards, tokenizer, rank, world, workers):
    stream = _stream(shards, tokenizer, rank, world)
    return StatefulLoader(
        stream, batch_size=BATCH, num_workers=workers, collate_fn=stream.collate(BATCH)
    )


def _pieces(batch) -> list[tuple]:
    """(doc id, start, tokens) of every piece in a batch."""
    out = []
    for r, (ids, starts) in enumerate(zip(batch["doc_ids"], batch["doc_starts"], strict=True)):
        lengths = batch["seq_lens"][r][: len(ids)].tolist()
        row = batch["input_ids"][r].tolist()
        at = 0
        for doc, start, n in zip(ids, starts, lengths, strict=True):
            out.append((int(doc), int(start), row[at : at + n]))
            at += n
    return out


def _rebuilt(pieces) -> dict[int, list[int]]:
    """Documents rebuilt from their pieces, each token position counted: a repeat or a gap
    fails."""
    by_doc = collections.defaultdict(list)
    for doc, start, tokens in pieces:
        by_doc[doc].append((start, tokens))
    docs = {}
    for doc, parts in by_doc.items():
        parts.sort()
        tokens = []
        for start, piece in parts:
            assert start == len(tokens), f"document {doc}: a piece at {start} after {len(tokens)}"
            tokens.extend(piece)
        docs[doc] = tokens
    return docs


def _check_rows(batches):
    for batch in batches:
        used = int(batch["num_tokens"][0])
        assert batch["input_ids"].shape == (BATCH, SEQ_LEN)
        assert used <= BATCH * SEQ_LEN


def test_an_epoch_on_2_ranks_x_2_workers_gives_every_document_as_tokenized(
    shards, tokenizer, expected
):
    pieces = []
    full_rows = 0
    for rank in range(2):
        batches = list(_loader(shards, tokenizer, rank, 2, 2))
        _check_rows(batches)
        for batch in batches:
            lengths = batch["seq_lens"].sum(dim=1)
            full_rows += int((lengths == SEQ_LEN).sum())
            pieces.extend(_pieces(batch))
    assert _rebuilt(pieces) == expected
    total = sum(len(t) for t in expected.values())
    # every row full but each of the 4 consumers' last
    assert full_rows >= total // SEQ_LEN - 4


def _epoch_over_shapes(shards, tokenizer, shapes):
    """Epoch 0 over `shapes` (ranks, workers, steps; None: to the end), each later shape loading
    rank 0's state as JSON: the pieces the loops received, and the states' sizes."""
    pieces = []
    sizes = []
    state = None
    for world, workers, steps in shapes:
        loaders = []
        for rank in range(world):
            loader = _loader(shards, tokenizer, rank, world, workers)
            if state is not None:
                loader.load_state_dict(json.loads(state))
            loaders.append(loader)
        iterators = [iter(loader) for loader in loaders]
        if steps is None:
            for iterator in iterators:
                for batch in iterator:
                    pieces.extend(_pieces(batch))
            return pieces, sizes
        for _ in range(steps):
            for iterator in iterators:
                pieces.extend(_pieces(next(iterator)))
        state = json.dumps(loaders[0].state_dict())
        sizes.append(len(state))
        del iterators


@pytest.mark.parametrize("then", [(3, 1), (1, 2), (2, 1)])
def test_stopped_at_a_random_batch_and_resumed_on_another_shape_gives_every_token_once(
    shards, tokenizer, expected, then
):
    steps = random.Random(str(then)).randint(1, 6)
    pieces, sizes = _epoch_over_shapes(shards, tokenizer, [(2, 2, steps), (*then, None)])
    assert _rebuilt(pieces) == expected
    assert max(sizes) < 4096


def test_a_rest_stopped_again_goes_on_on_another_shape(shards, tokenizer, expected):
    shapes = [(2, 2, 3), (3, 1, 2), (1, 2, None)]
    pieces, sizes = _epoch_over_shapes(shards, tokenizer, shapes)
    assert _rebuilt(pieces) == expected
    assert max(sizes) < 4096


def test_rows_longer_than_every_document_resumed_after_the_last_row_give_nothing_more(
    shards, tokenizer, expected
):
    """seq_len above the whole corpus: one (padded) row per consumer. A state saved after
    every row was received resumes on another shape to nothing (no IndexError, no repeat)."""
    pieces = []
    loaders = []
    for rank in range(2):
        stream = PackedTextStream(_documents(shards, rank, 2), tokenizer, seq_len=100_000)
        loaders.append(
            StatefulLoader(stream, batch_size=1, num_workers=2, collate_fn=stream.collate(1))
        )
    iterators = [iter(loader) for loader in loaders]
    for _ in range(2):  # each worker's only row
        for iterator in iterators:
            pieces.extend(_pieces(next(iterator)))
    state = json.loads(json.dumps(loaders[0].state_dict()))
    del iterators
    stream = PackedTextStream(_documents(shards), tokenizer, seq_len=100_000)
    resumed = StatefulLoader(stream, batch_size=1, collate_fn=stream.collate(1))
    resumed.load_state_dict(state)
    assert list(resumed) == []
    assert _rebuilt(pieces) == expected


def test_a_resume_on_the_same_shape_goes_on_exactly(shards, tokenizer):
    def rows(batches):
        return [(b["input_ids"].tolist(), b["doc_ids"]) for b in batches]

    whole = rows(_loader(shards, tokenizer, 0, 1, 2))
    first = _loader(shards, tokenizer, 0, 1, 2)
    iterator = iter(first)
    prefix = rows(next(iterator) for _ in range(5))
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    for workers in (2, 0):  # the same workers, or the old workers' order in one process
        resumed = _loader(shards, tokenizer, 0, 1, workers)
        resumed.load_state_dict(state)
        assert prefix + rows(resumed) == whole


def test_the_loader_recipe_and_pickling(shards, tokenizer, expected):
    documents = _documents(shards)
    loader = packed_text_loader(documents, tokenizer, seq_len=SEQ_LEN, batch_size=BATCH)
    pieces = [p for batch in loader for p in _pieces(batch)]
    assert _rebuilt(pieces) == expected
    stream = pickle.loads(pickle.dumps(loader.dataset))
    assert stream.seq_len == SEQ_LEN
    rest = stream.resume_after(2, batch_size=BATCH, num_workers=2, reshaped=[[2, 2, 1, 1]])
    pickle.loads(pickle.dumps(rest))


def _read_b(path, start, stop):
    return [{"id": 10_000 + d["id"], "text": d["text"]} for d in _read(path, start, stop)]


def test_mixed_in_token_shares_and_monitored_every_document_comes_once(shards, tokenizer, expected):
    b = ShardedIterableDataset(shards, _read_b, shard_lengths=SIZES, split="samples", seed=1)
    streams = {
        "a": _stream(shards, tokenizer),
        "b": PackedTextStream(b, tokenizer, seq_len=SEQ_LEN),
    }
    mixed = MixtureIterable(streams, {"a": 0.5, "b": 0.5}, seed=3, lengths="input_ids")
    collate = streams["a"].collate(BATCH)
    loader = make_loader(mixed, batch_size=BATCH, collate_fn=collate)
    monitor = LoaderMonitor(loader, warn_wait_fraction=1.0)
    pieces = [p for batch in monitor for p in _pieces(batch)]
    both = dict(expected)
    both.update({10_000 + doc: tokens for doc, tokens in expected.items()})
    assert _rebuilt(pieces) == both
    assert "epoch" in monitor.report().lower()


def test_bad_settings_are_refused(shards, tokenizer):
    with pytest.raises(ValueError, match="seq_len"):
        PackedTextStream(_documents(shards), tokenizer, seq_len=0)
    with pytest.raises(ValueError, match="consumer_samples"):
        PackedTextStream([{"id": 0, "text": "a"}], tokenizer, seq_len=8)
    with pytest.raises(ValueError, match="eos"):
        PackedTextStream(_documents(shards), tokenizer, seq_len=8, append_eos=True)
    stream = PackedTextStream(_documents(shards), tokenizer, seq_len=8, text_key="body")
    with pytest.raises(KeyError, match="body"):
        next(iter(stream))


def _parts(lengths):
    return [
        TokenizedPart(d, 0, np.arange(n, dtype=np.int64) + 1000 * d) for d, n in enumerate(lengths)
    ]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=12),
    seq_len=st.integers(1, 30),
)
def test_rows_keep_the_concatenation_and_each_cursor_resumes_it(lengths, seq_len):
    parts = _parts(lengths)
    rows = list(pack_rows(parts, seq_len))
    flat = [p.tokens for row in rows for p in row.pieces]
    whole = np.concatenate([p.tokens for p in parts] + [np.zeros(0, np.int64)])
    assert np.array_equal(np.concatenate(flat + [np.zeros(0, np.int64)]), whole)
    assert all(sum(len(p.tokens) for p in row.pieces) == seq_len for row in rows[:-1])
    for row in rows:
        for piece in row.pieces:
            start = piece.start
            assert np.array_equal(
                piece.tokens, parts[piece.doc_id].tokens[start : start + len(piece.tokens)]
            )
    if rows:  # the last row's end leaves nothing but empty documents
        end = rows[-1].end
        assert end.taken == 0 and all(len(p.tokens) == 0 for p in parts[end.part :])
    for k, row in enumerate(rows):  # packing again from a row's end gives the rows after it
        part, taken = row.end
        rest = parts[part:]
        if taken:
            cut = parts[part]
            rest = [TokenizedPart(cut.doc_id, taken, cut.tokens[taken:])] + parts[part + 1 :]
        again = list(pack_rows(rest, seq_len))
        after = rows[k + 1 :]
        assert len(again) == len(after)
        for a, b in zip(again, after, strict=True):
            assert [(p.doc_id, p.start, p.tokens.tolist()) for p in a.pieces] == [
                (p.doc_id, p.start, p.tokens.tolist()) for p in b.pieces
            ]
