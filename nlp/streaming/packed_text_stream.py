"""PackedTextStream: documents tokenized on the fly and packed into rows of exactly `seq_len`
tokens, with their boundaries, resumed exactly on any number of ranks and workers.

Use when: pretraining on a corpus too large to tokenize into a token cache first (`TokenCache`
and `packed_loader` are the ceiling when you can): the documents come from a shard set exact
over ranks and workers (`ShardedIterableDataset`, with `shard_lengths` for an elastic resume),
each worker tokenizes its own in batches and packs them (`row_packing.py`).
Cost: per worker, the tokenizer's batch encoder (a fast tokenizer's releases the GIL) and
numpy slices; per resume, the tokens each old consumer had seen tokenized again once
(`stream_rest.py`). The loader's state stays a few integers per shape.
Adapt here: `tokenize_batch`, `append_eos`; the cut rule is `row_packing.pack_rows`'.
Trade-off: rows are packed greedily in stream order (cut documents, no best fit); each worker's
last row of an epoch is padded (at most ranks x workers padded rows per epoch), never carried
into the next epoch, so an epoch holds exactly its documents' tokens. Ranks get as many rows
as their documents' tokens make: stop an epoch at a common step under DDP.

Row (an item): `input_ids` int64 `[n]` (n = seq_len but each worker's last row), `seq_lens`
(its pieces' lengths), `doc_ids` and `doc_starts` (each piece's document id and the offset of
its first token in that document's tokens). `PackedRowCollate` lays a batch of rows out as
`packed_batch.py`'s `[B, T]` layout (`position_ids` restarting at every piece), plus `doc_ids`
and `doc_starts` as lists per row.
Copy with: common/caches/cache_files.py, common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated/child.py,
  common/loading/isolated/protocol.py, common/loading/isolated_loader.py, common/loading/loader.py,
  common/loading/loader_path.py, common/loading/loader_rules.py, common/loading/loop_probe.py,
  common/loading/stateful_loader.py, common/loading/thread_loader.py,
  common/loading/worker_rules.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sampling/bucketing.py, common/sampling/elastic_sampler.py,
  common/sampling/sharding.py, common/sizing/profiles.py, common/sizing/resources.py,
  common/sizing/sizing.py, common/sizing/tune_store.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py,
  nlp/collate.py, nlp/pack_plan.py, nlp/packed_batch.py, nlp/streaming/row_packing.py,
  nlp/streaming/stream_rest.py, nlp/tokenizing.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from recipes.common.loading.loader import make_loader
from recipes.common.resume.state_records import Shape
from recipes.nlp.packed_batch import PackCollate
from recipes.nlp.streaming.row_packing import Cursor, Row, pack_rows, tokenized
from recipes.nlp.streaming.stream_rest import (
    Consumer,
    ResumeAt,
    StartAt,
    StreamRest,
    given,
    interleaved,
    rest_over,
)
from recipes.nlp.tokenizing import batch_encoder, tokenizer_fingerprint


class PackedTextStream(IterableDataset):
    """Rows of `seq_len` tokens over `documents`, tokenized and packed in each worker.

    Args:
        documents: an iterable dataset of documents (dicts with a text and a stable id) exact
            over ranks and workers, with `consumer_samples` (a `ShardedIterableDataset`); its
            `shard_lengths` make the resume elastic.
        tokenizer: a `transformers` tokenizer (fast ones encode with the GIL released).
        seq_len: T, the tokens per row.
        text_key, id_key: where a document's text and its stable id are (`id_key` may be a
            tuple of keys: `("file", "row")` for `open_text_corpus`'s documents).
        add_special_tokens: the tokenizer's own framing (BOS/CLS, EOS/SEP) as it says.
        append_eos: also end every document with `tokenizer.eos_token_id`.
        tokenize_batch: documents per encode call.

    Resume: `resume_after` (make_loader's `StatefulLoader` calls it) on the same shape goes on
    exactly; on another number of ranks or workers (`reshaped=`, with `shard_lengths`) the
    epoch's rest is dealt over the new shape, every token once over both runs
    (`stream_rest.py`).

    Raises:
        ValueError: a bad `seq_len` or `tokenize_batch`, `append_eos` without an EOS token, or
            `documents` without `consumer_samples`.
    """

    recommended_profile = "text"  # make_loader: no pinned memory for small int batches

    def __init__(
        self,
        documents,
        tokenizer,
        *,
        seq_len: int,
        text_key: str = "text",
        id_key: str | tuple[str, ...] = "id",
        add_special_tokens: bool = True,
        append_eos: bool = False,
        tokenize_batch: int = 64,
    ):
        for name, value in (("seq_len", seq_len), ("tokenize_batch", tokenize_batch)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive int, but is {value!r} instead.")
        if not hasattr(documents, "consumer_samples"):
            raise ValueError(
                f"`documents` ({type(documents).__name__}) must tell each consumer's documents "
                "(`consumer_samples`): pass a ShardedIterableDataset."
            )
        if getattr(documents, "even", False) and int(documents.world_size) > 1:
            raise ValueError(
                "`documents` deals equal counts to the ranks (`even=True`), repeating up to "
                "world_size - 1 documents: their tokens would be packed twice. Rows per rank "
                "differ anyway (they follow the documents' tokens): open the documents with "
                "even=False."
            )
        self.suffix: tuple[int, ...] = ()
        if append_eos:
            if getattr(tokenizer, "eos_token_id", None) is None:
                raise ValueError(
                    "append_eos=True, but the tokenizer has no eos_token; set one or pass "
                    "append_eos=False."
                )
            self.suffix = (int(tokenizer.eos_token_id),)
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.text_key = text_key
        if isinstance(id_key, list):
            id_key = tuple(id_key)
        self.id_key = id_key
        self.add_special_tokens = bool(add_special_tokens)
        self.tokenize_batch = tokenize_batch
        self.world_size = int(documents.world_size)
        self.rank = int(documents.rank)
        self.nodes = int(getattr(documents, "nodes", 1))
        if not self.reshapes:  # the loader reads the epoch's first batches again instead
            self.resume_after = None
        self._encode = None  # the batch encoder, made on first use in each process
        self._fingerprint = None
        self._rest: StreamRest | None = None  # an interrupted epoch's rest (`resume_after`)
        self._start: StartAt | None = None  # where this shape stopped within it

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_encode"] = None
        return state

    @property
    def epoch(self) -> int:
        return int(self.documents.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Sets the documents' epoch (in shared memory: persistent workers see it)."""
        self.documents.set_epoch(epoch)

    @property
    def reshapes(self) -> bool:
        """Whether a resume deals the epoch's rest over any new shape: documents that tell
        their consumers' rests (`resume_consumed`, `shard_lengths`)."""
        return bool(getattr(self.documents, "reshapes", False)) and hasattr(
            self.documents, "resume_consumed"
        )

    def plan_settings(self) -> dict:
        """What shapes the rows, for the loader's state check (not the ranks: a resume may
        change them)."""
        if self._fingerprint is None:
            info = json.dumps(tokenizer_fingerprint(self.tokenizer), sort_keys=True)
            self._fingerprint = hashlib.sha256(info.encode("utf-8")).hexdigest()[:16]
        return {
            "documents": getattr(self.documents, "plan_settings", dict)(),
            "tokenizer": self._fingerprint,
            "seq_len": self.seq_len,
            "text_key": self.text_key,
            "id_key": _json_key(self.id_key),
            "add_special_tokens": self.add_special_tokens,
            "suffix": list(self.suffix),
        }

    def collate(self, batch_size: int, *, max_docs_per_row: int | None = None) -> PackedRowCollate:
        """The collate function for `make_loader(batch_size=batch_size)` over these rows."""
        pad_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        return PackedRowCollate(
            self.seq_len, batch_size, pad_id=pad_id, max_docs_per_row=max_docs_per_row
        )

    # ---- rows ------------------------------------------------------------------------
    def rows_of(self, rest: StreamRest, consumer: Consumer, cursor: Cursor | None = None):
        """`consumer`'s packed rows of `rest` from `cursor` on (`row_packing.Row`)."""
        if self._encode is None:
            self._encode = batch_encoder(
                self.tokenizer, max_length=None, add_special_tokens=self.add_special_tokens
            )
        parts = tokenized(
            rest.parts(consumer, cursor),
            self._encode,
            text_key=self.text_key,
            id_key=self.id_key,
            batch=self.tokenize_batch,
            suffix=self.suffix,
        )
        return pack_rows(parts, self.seq_len)

    def _whole(self) -> StreamRest:
        return StreamRest(self.epoch, 0, self.documents, ())

    # ---- resuming (`stream_rest.py`) -------------------------------------------------
    def resume_after(
        self,
        batches_done: int,
        *,
        batch_size: int | None,
        drop_last: bool = False,
        num_workers: int = 0,
        interleave: bool = False,
        world_size: int | None = None,
        reshaped: Sequence[Sequence[int]] | None = None,
    ) -> PackedTextStream:
        """A copy whose epoch goes on after the first `batches_done` batches that a DataLoader
        with these settings yielded on this shape, after the epoch's earlier shapes `reshaped`
        (`[ranks, workers, batches each rank received, nodes]`, oldest first), whose rest is
        dealt over this shape. `interleave`: the rest of this shape in one process, as whole
        batches in the old workers' order (another worker count).

        Raises:
            ValueError: another number of ranks without `reshaped`.
        """
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"PackedTextStream deals an epoch's rest over new ranks ({world_size} -> "
                f"{self.world_size}) only from the loader's earlier shapes (`reshaped`); resume "
                "with make_loader's StatefulLoader."
            )
        shapes = [Shape.from_state(shape) for shape in reshaped or []]
        resumed = copy.copy(self)
        resumed._rest = rest_over(self._whole(), shapes, self.rows_of, batch_size, drop_last)
        resumed._start = None
        if batches_done or interleave:
            workers = max(1, int(num_workers))
            point = ResumeAt(int(batches_done), batch_size, bool(drop_last), workers, interleave)
            consumers = self._consumers(workers)
            rows = [self.rows_of(resumed._rest, c) for c in consumers]
            cursors, first = given(rows, point)
            resumed._start = StartAt(cursors, first, point)
        return resumed

    def _consumers(self, workers: int) -> list[Consumer]:
        return [Consumer(self.rank, self.world_size, w, workers) for w in range(workers)]

    # ---- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = 0
        workers = 1
        if info is not None:
            worker = info.id
            workers = info.num_workers
        rest = self._rest
        start = self._start
        if rest is None or rest.epoch != self.epoch:
            rest = self._whole()
            start = None
        if start is None:
            consumer = Consumer(self.rank, self.world_size, worker, workers)
            yield from _items(self.rows_of(rest, consumer))
            return
        point = start.point
        old = self._consumers(point.workers)
        if not point.interleave:
            role = (worker + start.first) % point.workers
            yield from _items(self.rows_of(rest, old[role], start.cursors[role]))
            return
        order = [(start.first + j) % point.workers for j in range(point.workers)]
        streams = {w: _items(self.rows_of(rest, old[w], start.cursors[w])) for w in order}
        yield from interleaved(streams, order, point)


def _items(rows: Iterator[Row]) -> Iterator[dict]:
    """Rows as the dataset's items (module docstring)."""
    for row in rows:
        yield {
            "input_ids": torch.from_numpy(np.concatenate([p.tokens for p in row.pieces])),
            "seq_lens": [len(p.tokens) for p in row.pieces],
            "doc_ids": [p.doc_id for p in row.pieces],
            "doc_starts": [p.start for p in row.pieces],
        }


class PackedRowCollate:
    """A batch of `PackedTextStream` rows in `packed_batch.py`'s `[B, T]` layout (a batch with
    fewer rows, the epoch's last, is padded with empty rows), plus `doc_ids` and `doc_starts`
    (lists per row).

    Args:
        seq_len: T.
        batch_size: B.
        pad_id: the id on padding.
        max_docs_per_row: D, the width of `seq_lens` (default T: always enough).
    """

    def __init__(
        self, seq_len: int, batch_size: int, *, pad_id: int = 0, max_docs_per_row: int | None = None
    ):
        self.pack = PackCollate(
            seq_len, batch_size, pad_id=pad_id, max_docs_per_row=max_docs_per_row
        )

    def __call__(self, rows: Sequence[dict]) -> dict:
        items = []
        for r, row in enumerate(rows):
            for piece in torch.split(row["input_ids"], row["seq_lens"]):
                items.append({"input_ids": piece, "row": r})
        batch = self.pack(items)
        batch["doc_ids"] = [row["doc_ids"] for row in rows]
        batch["doc_starts"] = [row["doc_starts"] for row in rows]
        return batch


def packed_text_loader(
    documents,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    append_eos: bool = False,
    tokenize_batch: int = 64,
    text_key: str = "text",
    id_key: str | tuple[str, ...] = "id",
    **make_loader_overrides,
):
    """A DataLoader of packed `[batch_size, seq_len]` batches tokenized on the fly from
    `documents` (a `ShardedIterableDataset` of dicts with `text_key` and `id_key`: `("file",
    "row")` for `open_text_corpus`'s documents), through
    `make_loader` (the `text` profile). Its `dataset` is the `PackedTextStream`: call
    `loader.dataset.set_epoch(epoch)` before each epoch.

    Example:
        >>> loader = packed_text_loader(documents, tokenizer, seq_len=2048, batch_size=8)
        >>> for batch in loader:
        ...     mask = document_attention_mask(batch["position_ids"])
    """
    stream = PackedTextStream(
        documents,
        tokenizer,
        seq_len=seq_len,
        text_key=text_key,
        id_key=id_key,
        append_eos=append_eos,
        tokenize_batch=tokenize_batch,
    )
    return make_loader(
        stream,
        batch_size=batch_size,
        collate_fn=stream.collate(batch_size),
        **make_loader_overrides,
    )


def _json_key(key: str | tuple[str, ...]) -> str | list[str]:
    """A key as a state's plan holds it (JSON has no tuples)."""
    if isinstance(key, tuple):
        return list(key)
    return key
