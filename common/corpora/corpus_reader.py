"""CorpusReader: `read_shard(path, start, stop)` of a planned corpus, for `ShardedIterableDataset`:
rows `[start, stop)` of one object, checked against its plan, as documents with their ids.

Use when: a `TextCorpus` makes its dataset (`TextCorpus.dataset`); its shards are the corpus's
objects, `shard_lengths` their rows.
Cost: per call, one `info()` (a HEAD) to check the object's version, then Parquet: the footer and
the row groups of the range (ranged reads, `columns` only); JSONL: the lines from the nearest
block start, or on from where this process's last read of the object stopped. With a
`PrefetchCache`, JSONL objects are read from their local copy (downloaded once per node, verified
by the sha256 of the plan) with no request.
Adapt here: `MAX_CURSORS` (compressed JSONL streams kept open per process).
Trade-off: the version check costs a request per read; it is what keeps a changed object from
being served with an old plan mid-epoch (`CorpusChangedError`).
Copy with: common/caches/cache_files.py, common/corpora/corpus_formats.py,
  common/corpora/corpus_index.py, common/corpora/corpus_objects.py, common/remote/object_urls.py,
  common/remote/request_pacing.py, common/remote/retries.py, common/workers/held_descriptors.py.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from recipes.common.corpora.corpus_formats import (
    BLOCK_ROWS,
    HashingReader,
    decompressed,
    document,
    jsonl_lines,
    parquet_file,
    parquet_rows,
)
from recipes.common.corpora.corpus_index import ObjectPlan
from recipes.common.corpora.corpus_objects import (
    CorpusChangedError,
    CorpusFormatError,
    object_version,
)
from recipes.common.remote.object_urls import open_filesystem
from recipes.common.remote.request_pacing import RequestPacer
from recipes.common.remote.retries import call_with_retries

MAX_CURSORS = 4
FILE_KEY = "file"  # a document's id: the index of its object in the plan, and its row there
ROW_KEY = "row"


class Remote(NamedTuple):
    """How a reader reaches the objects: fsspec `storage_options`, `retries` after the first
    attempt, the first retry's `backoff` in seconds, and the `pacer` of its requests."""

    storage_options: dict
    retries: int
    backoff: float
    pacer: RequestPacer


class Cursor(NamedTuple):
    """An open JSONL stream of one object (`path`), its `lines`, and the `row` its next line is."""

    path: str
    stream: object
    lines: Iterator[bytes]
    row: int


def check_unchanged(plan: ObjectPlan, info: dict) -> None:
    """Raises `CorpusChangedError` unless `info` (the object now) matches the plan's version."""
    now = object_version(info)
    same = now == plan.object_version and info.get("size") in (None, plan.size)
    if not same:
        raise CorpusChangedError(
            f"{plan.url} changed since the corpus was planned (version {plan.object_version}, "
            f"now {now}; {plan.size} bytes, now {info.get('size')}): its rows are not the plan's. "
            "Open the corpus again (a new plan) and restart the epoch."
        )


class CorpusReader:
    """Reads rows of the planned objects `plans` as `{text_key: str, *columns, "file": int,
    "row": int}`; `cached` maps a `PrefetchCache` copy's path to its URL."""

    def __init__(
        self,
        plans: Sequence[ObjectPlan],
        *,
        text_key: str,
        columns: Sequence[str],
        remote: Remote,
        cached: dict[str, str] | None = None,
    ):
        self.plans = list(plans)
        self.text_key = text_key
        self.columns = tuple(columns)
        self.remote = remote
        self.by_path = {plan.url: i for i, plan in enumerate(self.plans)}
        for path, url in (cached or {}).items():
            self.by_path[path] = self.by_path[url]
        self._fs: dict = {}
        self._cursors: collections.OrderedDict[int, Cursor] = collections.OrderedDict()

    def __call__(self, path, start: int = 0, stop: int | None = None) -> Iterator[dict]:
        file = self.by_path[str(path)]
        plan = self.plans[file]
        if stop is None:
            stop = plan.rows
        if plan.format == "parquet":
            return self._parquet(file, plan, start, stop)
        return self._jsonl(file, str(path), start, stop)

    # ---- requests ------------------------------------------------------------------------
    def _retried(self, call):
        remote = self.remote
        return call_with_retries(call, retries=remote.retries, backoff=remote.backoff)

    def _open_checked(self, plan: ObjectPlan):
        """The object opened for reading, after checking that it is the plan's version."""
        fs, path = open_filesystem(plan.url, self.remote.storage_options, 4, self._fs)

        def attempt():
            self.remote.pacer.wait()
            fs.invalidate_cache(path)  # s3fs answers `info` from its listing otherwise
            check_unchanged(plan, fs.info(path))
            self.remote.pacer.wait()
            return fs.open(path, "rb")

        return self._retried(attempt)

    # ---- Parquet: the row groups of the range --------------------------------------------
    def _parquet(self, file: int, plan: ObjectPlan, start: int, stop: int) -> Iterator[dict]:
        columns = (self.text_key, *self.columns)
        with self._open_checked(plan) as handle:
            parquet = self._retried(lambda: parquet_file(handle, plan.url))
            names = parquet.schema_arrow.names
            missing = [name for name in columns if name not in names]
            if missing:  # pyarrow reads a row group without them, silently
                raise CorpusFormatError(
                    f"{plan.url} has no column {missing[0]!r} (its columns: {names}); pass the "
                    "column of the text as text_key= and others as columns=."
                )
            groups = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
            if tuple(groups) != plan.row_groups:
                raise CorpusChangedError(
                    f"{plan.url} has row groups of {groups} rows, but its plan {plan.row_groups}: "
                    "it changed since the corpus was planned. Open the corpus again."
                )
            first = 0
            for group, count in enumerate(groups):
                if first < stop and first + count > start:
                    rows = self._retried(
                        lambda g=group: parquet_rows(parquet, plan.url, g, columns)
                    )
                    for row in range(max(start, first), min(stop, first + count)):
                        yield self._identified(rows[row - first], file, row)
                first += count

    def _identified(self, record: dict, file: int, row: int) -> dict:
        record[FILE_KEY] = file
        record[ROW_KEY] = row
        return record

    # ---- JSONL: streamed lines -----------------------------------------------------------
    def _jsonl(self, file: int, path: str, start: int, stop: int) -> Iterator[dict]:
        plan = self.plans[file]
        cursor = self._cursor(file, path, start)
        done = False
        got = 0
        try:
            for row, line in zip(range(start, stop), cursor.lines, strict=False):
                record = document(line, plan.url, row, self.text_key, self.columns)
                got += 1
                yield self._identified(record, file, row)
            if stop == plan.rows and next(cursor.lines, None) is not None:
                got = -1  # more lines than planned
            self._check_rows(plan, got, stop - start)
            done = True
        finally:
            if done and stop < plan.rows:  # the next read of this object may go on from here
                self._cursors[file] = cursor._replace(row=stop)
                self._trim_cursors()
            else:
                cursor.stream.close()

    def _check_rows(self, plan: ObjectPlan, got: int, wanted: int) -> None:
        if got != wanted:
            raise CorpusChangedError(
                f"{plan.url} does not have the {plan.rows} rows of its plan: it changed since the "
                "corpus was planned. Open the corpus again."
            )

    def _cursor(self, file: int, path: str, start: int) -> Cursor:
        """A stream of `file`'s lines at row `start`: this process's last one if it stopped at or
        before `start`, else a new one from the nearest block start."""
        plan = self.plans[file]
        cursor = self._cursors.pop(file, None)
        if cursor is not None and (cursor.path != path or cursor.row > start):
            cursor.stream.close()
            cursor = None
        if cursor is None:
            cursor = self._open_lines(plan, path, start)
        skip = start - cursor.row
        if skip and next(itertools.islice(cursor.lines, skip - 1, None), None) is None:
            cursor.stream.close()
            self._check_rows(plan, -1, 0)
        return cursor._replace(row=start)

    def _open_lines(self, plan: ObjectPlan, path: str, start: int) -> Cursor:
        if path != plan.url:  # the cache's copy, verified against the plan's sha256
            raw = open(path, "rb")
        else:
            raw = self._open_checked(plan)
        row = 0
        if plan.block_offsets:
            block = start // BLOCK_ROWS
            raw.seek(plan.block_offsets[block])
            row = block * BLOCK_ROWS
        stream = decompressed(HashingReader(raw), plan.compression, plan.url)
        return Cursor(path, _Closing(stream, raw), jsonl_lines(stream, plan.url), row)

    def _trim_cursors(self) -> None:
        while len(self._cursors) > MAX_CURSORS:
            _, oldest = self._cursors.popitem(last=False)
            oldest.stream.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_fs={}, _cursors=collections.OrderedDict())
        return state


class _Closing:
    """Closes a decompressing stream and the object under it."""

    def __init__(self, *streams):
        self.streams = streams

    def close(self) -> None:
        for stream in self.streams:
            with contextlib.suppress(Exception):
                stream.close()
