"""The rest of an interrupted `PackedTextStream` epoch: where each old consumer (rank x worker)
stood in its documents, the documents no consumer received dealt over the new shape, and the
documents cut at a row's end carried once.

Use when: a loader resumes a `PackedTextStream` (`resume_after`) on the same or another number
of ranks and workers. Each consumer's rows are a function of the settings (its documents come
from the source's plan, its tokens from the tokenizer), so the batches a loader received say
how many rows each old consumer gave (DataLoader's round-robin over its workers); packing its
documents again up to those rows finds the cursor after them: the documents it received
whole, and the one cut at its last row's end (identity and offset: `Part`). The source deals
what no consumer received over the new shape (`resume_consumed`), and the cut documents'
rests (`StreamRest.carried`, at most one per old consumer, plus any carried part not reached)
are dealt round-robin over the new consumers, each packed once, before their documents.
Cost: per resume, each old consumer's documents tokenized again up to where it stopped (one
batch of rows beyond): the tokens seen, once, in the resuming process. The state stays a few
integers per shape (the loader's batch counts); nothing of the tokens is saved.
Adapt here: `StreamRest.carried_for` (who packs which carried rest).
Trade-off: a resumed epoch's rows are not an uninterrupted run's on the new shape (no such run
exists); its tokens are: every token of the epoch once over all the runs. On the same shape
the rows go on exactly as they would have.
Copy with: common/resume/state_keys.py, common/resume/state_records.py,
  nlp/streaming/row_packing.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from recipes.common.resume.state_records import ResumeAt
from recipes.nlp.streaming.row_packing import Cursor, Part, Row


class Consumer(NamedTuple):
    """One reader of an epoch: a worker of a rank, in a shape of ranks x workers."""

    rank: int
    ranks: int
    worker: int
    workers: int

    @property
    def index(self) -> int:
        return self.rank * self.workers + self.worker


class StartAt(NamedTuple):
    """Where each old worker of this rank stands in the current rest, and who is due next."""

    cursors: list[Cursor]
    first: int
    point: ResumeAt


class StreamRest(NamedTuple):
    """What no consumer received of an epoch over its earlier shapes: the source's documents
    (a copy over its rest; the source itself at generation 0), and the rests of the documents
    cut at an old row's end."""

    epoch: int
    generation: int
    documents: Any  # a ShardedIterableDataset (or its `resume_consumed` copy)
    carried: tuple[Part, ...]

    def carried_for(self, consumer: Consumer) -> list[Part]:
        """The carried rests `consumer` packs first: every (ranks x workers)-th."""
        count = consumer.ranks * consumer.workers
        return list(self.carried[consumer.index :: count])

    def parts(self, consumer: Consumer, cursor: Cursor | None = None) -> Iterator[Part]:
        """`consumer`'s parts from `cursor` on (default: the start): its carried rests, then its
        documents."""
        if cursor is None:
            cursor = Cursor(0, 0)
        mine = self.carried_for(consumer)
        skip = cursor.part - len(mine)
        taken = cursor.taken
        if cursor.part < len(mine):
            first = mine[cursor.part]
            yield Part(first.document, first.start + cursor.taken)
            yield from mine[cursor.part + 1 :]
            skip = 0
            taken = 0
        for i, document in enumerate(self._documents(consumer, skip)):
            start = 0
            if i == 0:
                start = taken
            yield Part(document, start)

    def leftover(self, consumer: Consumer, cursor: Cursor) -> tuple[int, list[Part]]:
        """After `cursor`: the documents `consumer` received of the source (the cut one too),
        and the parts it leaves to carry (its carried rests not reached, the cut document)."""
        mine = self.carried_for(consumer)
        if cursor.part < len(mine):
            first = mine[cursor.part]
            rest = [Part(first.document, first.start + cursor.taken)] + mine[cursor.part + 1 :]
            return 0, rest
        received = cursor.part - len(mine)
        if cursor.taken == 0:
            return received, []
        cut = next(iter(self._documents(consumer, received)))
        return received + 1, [Part(cut, cursor.taken)]

    def _documents(self, consumer: Consumer, skip: int) -> Iterator:
        return self.documents.consumer_samples(
            consumer.rank,
            consumer.ranks,
            worker=consumer.worker,
            workers=consumer.workers,
            skip=skip,
        )


def given(rows: Sequence[Iterator[Row]], point: ResumeAt) -> tuple[list[Cursor], int]:
    """Each worker's cursor after `point.batches_done` batches of DataLoader's round-robin over
    workers whose rows are `rows[w]` (a worker that runs out leaves the round, as
    `sharding.round_robin_position`), and the worker due next (0 when the epoch is over)."""
    batches = [_batch_ends(r, point.per_batch, point.drop_last) for r in rows]
    pending = [next(b, None) for b in batches]
    cursors = [Cursor(0, 0)] * len(rows)
    done = point.batches_done
    while any(p is not None for p in pending):
        for w, end in enumerate(pending):
            if end is None:
                continue
            if done == 0:
                return cursors, w
            cursors[w] = end
            done -= 1
            pending[w] = next(batches[w], None)
    return cursors, 0


def rest_over(
    rest: StreamRest,
    shapes: Sequence,
    rows_of: Callable[[StreamRest, Consumer], Iterator[Row]],
    batch_size: int | None,
    drop_last: bool,
) -> StreamRest:
    """What no consumer received over the epoch's earlier `shapes` (`state_records.Shape`,
    oldest first), each shape's consumers reading the rest of the shape before it; `rest` is
    the epoch's whole (generation 0), `rows_of` packs a consumer's rows of a rest."""
    source = rest.documents
    received: list[tuple] = []
    for shape in shapes:
        workers = max(1, int(shape.workers))
        point = ResumeAt(int(shape.batches), batch_size, bool(drop_last), workers, False)
        counts = np.zeros((shape.ranks, workers), dtype=np.int64)
        carried: list[Part] = []
        for rank in range(shape.ranks):
            consumers = [Consumer(rank, shape.ranks, w, workers) for w in range(workers)]
            cursors, _ = given([rows_of(rest, c) for c in consumers], point)
            for consumer, cursor in zip(consumers, cursors, strict=True):
                count, parts = rest.leftover(consumer, cursor)
                counts[rank, consumer.worker] = count
                carried.extend(parts)
        received.append((shape.ranks, workers, counts.tolist(), int(shape.nodes)))
        rest = StreamRest(
            rest.epoch, rest.generation + 1, source.resume_consumed(received), tuple(carried)
        )
    return rest


def interleaved(streams: dict[int, Iterator], order: list[int], point: ResumeAt) -> Iterator:
    """The old workers' `streams` as DataLoader yields them, whole batches (lists) in `order`
    (a worker that runs out leaves the round)."""
    while streams:
        for w in order:
            if w not in streams:
                continue
            batch = list(itertools.islice(streams[w], point.per_batch))
            short = len(batch) < point.per_batch
            if not batch or (point.drop_last and short):
                del streams[w]
                continue
            if point.batch_size is None:
                yield batch[0]
            else:
                yield batch


def _batch_ends(rows: Iterator[Row], per_batch: int, drop_last: bool) -> Iterator[Cursor]:
    """The cursor after each batch a worker with these rows gives."""
    while True:
        batch = list(itertools.islice(rows, per_batch))
        if not batch or (drop_last and len(batch) < per_batch):
            return
        yield batch[-1].end
