"""TextCorpus: Parquet and JSONL text corpora read where they live (a folder, a glob, S3, HTTP,
`hf://datasets/...`), as a `ShardedIterableDataset` of their documents, with nothing written
beside them.

Use when: pretraining or fine-tuning text lives in Parquet or JSONL (plain, `.gz`, `.zst`) files
in a bucket or on the Hugging Face Hub, and copying or converting them first is what you want to
avoid. Every document comes once per epoch over ranks and workers, mixed over a band of objects,
resumed exactly on another shape (`ShardedIterableDataset`'s guarantees, with the objects as its
shards and their rows as `shard_lengths`).
Cost: `plan()`: a listing, one `info()` per object, then per object not in the local index (or
changed since), its Parquet footer (ranged reads) or one streamed read of its JSONL; in parallel,
with a progress bar. Reading: `corpus_reader.py`'s.
Adapt here: `PLAN_THREADS`; `requests_per_second` (the request budget of each process).
Trade-off: the plan is kept locally (`corpus_index.py`, under `~/.cache/recipes/corpora`), never
beside the source: each machine plans once per object version. A JSONL object is read whole to
be planned; with a `PrefetchCache` the dataset reads JSONL from a node-local copy (one download
per node), while Parquet is always read by ranged row-group reads.

The layers: `corpus_objects.py` (which files, their versions), `corpus_index.py` (the local
plans), `corpus_formats.py` (footers, lines, damage), `corpus_reader.py` (`read_shard`).
Copy with: common/caches/cache_files.py, common/caches/packed_strings.py,
  common/corpora/corpus_formats.py, common/corpora/corpus_index.py,
  common/corpora/corpus_objects.py, common/corpora/corpus_reader.py, common/remote/object_urls.py,
  common/remote/request_pacing.py, common/remote/retries.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/sharded_dataset.py,
  common/workers/held_descriptors.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from recipes.common.corpora.corpus_formats import BLOCK_ROWS, plan_jsonl, plan_parquet
from recipes.common.corpora.corpus_index import (
    ObjectPlan,
    default_index_dir,
    load_plan,
    save_plan,
)
from recipes.common.corpora.corpus_objects import (
    CorpusChangedError,
    CorpusFormatError,
    as_sources,
    list_objects,
    object_kind,
    object_version,
)
from recipes.common.corpora.corpus_reader import CorpusReader, Remote
from recipes.common.remote.object_urls import open_filesystem
from recipes.common.remote.request_pacing import RequestPacer
from recipes.common.remote.retries import call_with_retries
from recipes.common.shards.epochs.shard_mixing import WINDOW
from recipes.common.shards.sharded_dataset import ShardedIterableDataset

__all__ = ["CorpusChangedError", "CorpusFormatError", "TextCorpus", "open_text_corpus"]

PLAN_THREADS = 8


def open_text_corpus(
    url: str | Sequence[str],
    *,
    text_key: str = "text",
    columns: Sequence[str] = (),
    index_dir: str | Path | None = None,
    storage_options: dict | None = None,
    retries: int = 5,
    backoff: float = 0.5,
    requests_per_second: float | None = None,
) -> TextCorpus:
    """The Parquet and JSONL files under `url`, as a corpus; nothing is read until `plan()`.

    Args:
        url: a folder, a glob, a file or a list of them: local, `s3://`, `http(s)://` (files
            only: no listing), `hf://datasets/<owner>/<name>/...`, any fsspec URL.
        text_key: the column (Parquet) or field (JSONL) of the text.
        columns: other columns or fields to yield with it.
        index_dir: the local index of the plans; default `$RECIPES_CORPUS_DIR`, else
            `~/.cache/recipes/corpora`.
        storage_options: passed to fsspec (s3fs's `client_kwargs`, the Hub's `token`, ...).
        retries, backoff: retries of each request after transient errors (5xx, 429, resets),
            the first after `backoff` seconds, doubling; a 429 or 503's `Retry-After` wins.
        requests_per_second: the most requests per second of each process (None: no cap).

    Returns:
        A `TextCorpus`; `corpus.dataset(...)` plans it if `plan()` was not called.

    Example:
        >>> corpus = open_text_corpus("s3://bucket/fineweb/*.parquet").plan()
        >>> loader = make_loader(corpus.dataset(seed=0), batch_size=32)
    """
    if retries < 0 or backoff < 0:
        raise ValueError(
            f"`retries` and `backoff` must be non-negative, but are {retries!r} and {backoff!r}."
        )
    remote = Remote(
        dict(storage_options or {}), retries, backoff, RequestPacer(requests_per_second)
    )
    index = default_index_dir()
    if index_dir is not None:
        index = Path(index_dir)
    return TextCorpus(
        as_sources(url), text_key=text_key, columns=columns, index_dir=index, remote=remote
    )


class TextCorpus:
    """The documents of a corpus's objects, planned once (`plan`) and read as a dataset.

    Attributes:
        sources: the folders, globs or files given; `plans`: one `ObjectPlan` per object, in
        URL order (after `plan()`); `urls`, `lengths`: each object's URL and rows.
    """

    def __init__(
        self,
        sources: Sequence[str],
        *,
        text_key: str,
        columns: Sequence[str],
        index_dir: Path,
        remote: Remote,
    ):
        self.sources = list(sources)
        self.text_key = text_key
        self.columns = tuple(columns)
        self.index_dir = Path(index_dir)
        self.remote = remote
        self.plans: list[ObjectPlan] | None = None
        self._fs: dict = {}

    @property
    def urls(self) -> list[str]:
        return [plan.url for plan in self._planned()]

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([plan.rows for plan in self._planned()], dtype=np.int64)

    @property
    def num_documents(self) -> int:
        return int(self.lengths.sum())

    def plan(self, *, progress: bool = True) -> TextCorpus:
        """Lists the objects and plans each one: from the local index when its version is the
        one recorded, else from its Parquet footer or a read of its JSONL (then recorded).
        Called again, plans again (a changed object is planned anew). Returns self.

        Raises:
            FileNotFoundError: no corpus file at a source.
            CorpusFormatError: an object that does not read as its format (names it).
        """
        from tqdm.auto import tqdm

        urls = []
        for source in self.sources:
            fs, _ = self._filesystem(source)
            listed = call_with_retries(
                functools.partial(list_objects, fs, source),
                retries=self.remote.retries,
                backoff=self.remote.backoff,
            )  # a busy listing (429, 503) waits as the server asks
            for path in listed:
                urls.append(self._full_url(fs, source, path))
        urls = list(dict.fromkeys(urls))
        with ThreadPoolExecutor(min(PLAN_THREADS, len(urls))) as pool:
            bar = tqdm(total=len(urls), desc="planning corpus", unit="file", disable=not progress)
            with bar:
                plans = []
                for plan in pool.map(self._plan_object, urls):
                    plans.append(plan)
                    bar.update(1)
        self.plans = plans
        return self

    def dataset(
        self,
        *,
        shuffle: bool = True,
        seed: int = 0,
        even: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        cache=None,
        shuffle_window: int = WINDOW,
        split: str = "samples",
    ) -> ShardedIterableDataset:
        """The corpus's documents, `{text_key: str, *columns, "file": int, "row": int}` (the
        object's index in `urls` and the row in it: a document's id), split exactly over ranks
        and workers: the epoch's shuffled objects concatenated and cut into one contiguous
        range of documents per rank and worker (`split="samples"`), so each document comes once
        per epoch whatever the object count (with `even`, every rank the same count: at most
        `world_size - 1` documents repeat); `split="auto"` reads whole objects when there are
        enough, and with `even` drops the surplus of the ranks with more. See
        `ShardedIterableDataset` for `shuffle`, `seed`, `even`, `rank`, `world_size` and
        `shuffle_window`. Mixing cuts Parquet objects at their row groups and JSONL objects
        every `BLOCK_ROWS` rows.

        Args:
            cache: a `PrefetchCache` for JSONL corpora: each object downloaded once per node,
                verified by its plan's sha256 (an object changed since fails its download).

        Raises:
            ValueError: a `cache` for a corpus with Parquet objects (read by ranged row-group
                reads, never whole).
        """
        plans = self._planned()
        if cache is not None and any(plan.format == "parquet" for plan in plans):
            raise ValueError(
                "A Parquet corpus is read by ranged row-group reads, not through a cache; pass "
                "cache=None (a cache is for JSONL objects, which are read whole)."
            )
        cached = None
        sums = None
        if cache is not None:
            cached = {str(cache.path_for(plan.url)): plan.url for plan in plans}
            sums = [plan.sha256 for plan in plans]
        reader = CorpusReader(
            plans, text_key=self.text_key, columns=self.columns, remote=self.remote, cached=cached
        )
        return ShardedIterableDataset(
            [plan.url for plan in plans],
            reader,
            shard_lengths=[plan.rows for plan in plans],
            shuffle=shuffle,
            seed=seed,
            even=even,
            rank=rank,
            world_size=world_size,
            cache=cache,
            shard_sha256=sums,
            shard_versions=[plan.object_version for plan in plans],  # a rewrite refuses a state
            shuffle_window=shuffle_window,
            split=split,
            blocks=CorpusBlocks(plans),
        )

    # ---- planning ------------------------------------------------------------------------
    def _planned(self) -> list[ObjectPlan]:
        if self.plans is None:
            self.plan()
        return self.plans

    def _filesystem(self, url: str):
        return open_filesystem(url, self.remote.storage_options, PLAN_THREADS * 2, self._fs)

    def _full_url(self, fs, source: str, path: str) -> str:
        if "://" not in source and not source.startswith("file:"):
            return path  # a local path stays one
        return fs.unstrip_protocol(path)

    def _retried(self, call):
        remote = self.remote
        return call_with_retries(call, retries=remote.retries, backoff=remote.backoff)

    def _plan_object(self, url: str) -> ObjectPlan:
        fs, path = self._filesystem(url)

        def look() -> dict:
            self.remote.pacer.wait()
            fs.invalidate_cache(path)  # a listing's info may be older than the object
            return fs.info(path)

        info = self._retried(look)
        version = object_version(info)
        known = load_plan(self.index_dir, url, version)
        if known is not None:
            return known
        kind = object_kind(path)

        def read() -> ObjectPlan:
            self.remote.pacer.wait()
            with fs.open(path, "rb") as handle:
                if kind.format == "parquet":
                    return plan_parquet(handle, url, version, info.get("size"), self.text_key)
                return plan_jsonl(handle, url, kind, version, info.get("size"))

        plan = self._retried(read)
        save_plan(self.index_dir, plan)
        return plan


class CorpusBlocks:
    """Where the dataset may cut each object for mixing: Parquet row-group starts; every
    `BLOCK_ROWS` rows of JSONL."""

    def __init__(self, plans: Sequence[ObjectPlan]):
        self.cuts = []
        for plan in plans:
            if plan.format == "parquet" and plan.row_groups:
                starts = np.concatenate(([0], np.cumsum(plan.row_groups)[:-1]))
            else:
                starts = np.arange(0, max(plan.rows, 1), BLOCK_ROWS)
            self.cuts.append(starts.astype(np.int64))

    def __call__(self, shard: int) -> np.ndarray:
        return self.cuts[shard]
