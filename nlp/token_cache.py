"""Token cache: tokenize a corpus once into a memory-mapped flat token file.

Use when: the same texts are tokenized every epoch (in `__getitem__` or `map`), or a
tokenizer in DataLoader workers is the bottleneck. Items become slices of a memory map:
microseconds each, no tokenizer in the workers, and `lengths` for bucketing for free.
Cost: one pass of the fast tokenizer's batch API (Rust, multi-threaded) over the data, plus
a content hash of the data to decide reuse; 2 bytes per token (`uint16`) when the
vocabulary fits, else 4.
Adapt here: `_read_texts` for other input formats; `max_length` and `add_special_tokens`.
Trade-off: the cache is tied to one tokenizer configuration and one corpus; change either
and it is rebuilt (never silently reused: the key hashes the tokenizer's full serialized
content, its special tokens and the data, unlike a random fingerprint).

Layout of `cache_dir` (the `recipes.common.caches.cache_files` protocol: built in a temp folder,
fsynced, renamed into place; split over the ranks of a process group when one is initialised, each
node's folder ending with the whole cache):
  header.json   {"format": "recipes-token-cache", "version", "fingerprint", "count",
                 "num_tokens", "dtype", ...}
  tokens.bin    uint16/uint32 x num_tokens, all samples back to back
  offsets.bin   int64 x (count + 1); sample i is tokens[offsets[i]:offsets[i + 1]]
  checksums.bin uint64 x count: sample i's checksum, checked when read (`verify=`: "first_read"
                per process by default, "always" or "never"; `recipes.common.caches.cache_checks`)
The header holds its own checksum and those of `offsets.bin` and `checksums.bin` (checked on open).
  damaged.json  written when a read (or `recipes cache verify`) finds a damaged sample: the folder
                then fails to open, so `build_token_cache` rebuilds it instead of reusing it

The build's pieces: the tokenizer's fingerprint and batch encoder in `tokenizing.py`, the parts
each rank writes and their join in `token_cache_parts.py`.

The tokenizers fork hazard: a Rust tokenizer that has used its thread pool in the parent
can deadlock in forked DataLoader workers (tokenizers prints "The current process just got
forked, after parallelism has already been used"). Cached datasets never tokenize in
workers; `recipes.common.worker_init` also sets TOKENIZERS_PARALLELISM=false in each worker.
Copy with: common/caches/build_ranks.py, common/caches/cache_builds.py,
  common/caches/cache_checks.py, common/caches/cache_files.py, common/caches/cache_folder.py,
  common/caches/packed_strings.py, common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_content.py, common/shards/shard_formats.py, common/shards/shard_index.py,
  common/shards/shard_samples.py, common/shards/shard_set.py, common/shards/sharded_dataset.py,
  common/shards/tar_members.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, nlp/texts.py, nlp/token_cache_parts.py, nlp/tokenizing.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.caches.cache_builds import FolderBuild
from recipes.common.caches.cache_checks import (
    ItemChecks,
    VerifyMode,
    algorithm,
    check_damage,
    file_checksums,
    read_checked,
    write_item_sums,
)
from recipes.common.caches.cache_files import LazyMap, check_size, read_header
from recipes.common.caches.packed_strings import resolve_index, resolve_indices
from recipes.nlp.texts import TextSource
from recipes.nlp.token_cache_parts import join_parts, part_totals, write_part
from recipes.nlp.tokenizing import batch_encoder, tokenizer_fingerprint

FORMAT = "recipes-token-cache"
FORMAT_VERSION = 2  # 2: per-sample checksums, a header checksum
_BUILD_HINT = "build_token_cache() or `recipes cache nlp`"


class TokenCacheError(ValueError):
    """A token cache that is missing, truncated, corrupt or built from other inputs."""


class TokenCache(Dataset):
    """A map-style dataset over a token cache: `cache[i] == {"input_ids": LongTensor[L]}`.

    Pickles as its path and small arrays; each process opens its own memory map lazily, and
    a `tokens.bin` truncated or replaced since `open` raises `TokenCacheError` then (reopen).
    `make_loader(cache)` picks the `text` profile (no pinned memory: small int batches copy
    faster than they pin).

    Example:
        >>> cache = TokenCache.open("/cache/wiki-bpe")
        >>> len(cache), cache.lengths[:3], cache[0]["input_ids"]
    """

    recommended_profile = "text"

    def __init__(
        self,
        path: Path,
        header: dict,
        offsets: np.ndarray,
        sums: np.ndarray,
        verify: VerifyMode = "first_read",
    ):
        self.path = Path(path)
        self.header = header
        self.offsets = offsets
        self.lengths = np.diff(offsets)
        # copy-on-write: writable views for torch, the file is never written
        self._tokens = LazyMap(
            self.path / "tokens.bin",
            np.dtype(header["dtype"]).newbyteorder("<"),
            (int(header["num_tokens"]),),
            mode="c",
            error=TokenCacheError,
        )
        self.checks = ItemChecks(
            self.path / "tokens.bin",
            sums,
            header["checksum"],
            verify=verify,
            error=TokenCacheError,
            hint=_BUILD_HINT,
            label="sample",
        )

    @classmethod
    def open(
        cls,
        cache_dir: str | os.PathLike,
        *,
        fingerprint: str | None = None,
        verify: VerifyMode = "first_read",
    ) -> TokenCache:
        """Opens and validates a cache folder (header, sizes, checksums of the small files,
        offsets); `verify` says when a sample is checked as it is read.

        Raises:
            TokenCacheError: missing, truncated, damaged (a sample found damaged when read is
                recorded in `damaged.json`), another format version, or (with `fingerprint`)
                built from other inputs; the message says to rebuild.
        """
        path = Path(cache_dir)
        header = read_header(
            path,
            fmt=FORMAT,
            version=FORMAT_VERSION,
            fingerprint=fingerprint,
            error=TokenCacheError,
            build_hint=_BUILD_HINT,
            fields=("count", "num_tokens", "dtype", "checksum", "file_checksums"),
        )
        try:
            count = int(header["count"])
            num_tokens = int(header["num_tokens"])
            itemsize = np.dtype(header["dtype"]).itemsize
        except (TypeError, ValueError):
            raise TokenCacheError(
                f"{path}/header.json has invalid fields; rebuild the cache."
            ) from None
        check_size(path / "tokens.bin", num_tokens * itemsize, TokenCacheError)
        check_size(path / "offsets.bin", (count + 1) * 8, TokenCacheError)
        check_size(path / "checksums.bin", count * 8, TokenCacheError)
        offsets = read_checked(path, "offsets.bin", "<i8", header, TokenCacheError, _BUILD_HINT)
        sums = read_checked(path, "checksums.bin", "<u8", header, TokenCacheError, _BUILD_HINT)
        if offsets[0] != 0 or offsets[-1] != num_tokens or (count and (np.diff(offsets) < 0).any()):
            raise TokenCacheError(f"{path}/offsets.bin is corrupt; rebuild the cache.")
        # a read found damage: rebuild
        check_damage(path, ("tokens.bin",), TokenCacheError, _BUILD_HINT)
        return cls(path, header, offsets, sums, verify)

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    def __len__(self) -> int:
        return len(self.lengths)

    def _map(self) -> np.ndarray:
        return self._tokens.array

    def thread_batches(self) -> bool:
        """Items are gathers from a memory map: `make_loader` reads batches in threads
        (`ThreadLoader`)."""
        return True

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = resolve_index(index, len(self), f"the {len(self)} samples in {self.path}")
        ids = self._map()[self.offsets[i] : self.offsets[i + 1]]
        if self.checks.needed(i):
            self.checks.check(i, ids)
        return {"input_ids": torch.from_numpy(ids.astype(np.int64))}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """A whole batch with one gather from the memory map; items are views of one tensor."""
        idx = resolve_indices(indices, len(self), f"the {len(self)} samples in {self.path}")
        # each sample's first read in this process, by default
        for i in self.checks.pending(idx).tolist():
            self.checks.check(i, self._map()[self.offsets[i] : self.offsets[i + 1]])
        rows = self.read_spans(self.offsets[idx], self.lengths[idx])
        return [{"input_ids": row} for row in rows]

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> list[torch.Tensor]:
        """The tokens `[start, start + length)` of each span, as int64 views of one tensor read
        with one gather from the memory map (unchecked: `__getitems__` checks samples first)."""
        # positions of every token of the spans: each start, then +1 within its span
        shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        flat = self._map()[shift + np.arange(int(lengths.sum()))].astype(np.int64)
        return list(torch.from_numpy(flat).split(lengths.tolist()))

    def __repr__(self) -> str:
        return (
            f"TokenCache({str(self.path)!r}, n={len(self)}, tokens={self.header['num_tokens']:,}, "
            f"dtype={self.header['dtype']})"
        )


def cache_fingerprint(source: TextSource, tokenizer, *, max_length, add_special_tokens) -> str:
    key = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "add_special_tokens": add_special_tokens,
        "data": source.content_hash(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def build_token_cache(
    texts,
    tokenizer,
    cache_dir: str | os.PathLike,
    *,
    max_length: int | None = None,
    add_special_tokens: bool = True,
    text_field: str = "text",
    batch_size: int = 1000,
    progress: bool = True,
    distributed: bool | None = None,
) -> TokenCache:
    """Tokenizes `texts` once into `cache_dir`, or reuses the cache there when it matches.

    Args:
        texts: a sequence of strings, a `.txt` file (one sample per line), a `.jsonl` file
            (`text_field` of each line, also `.gz`/`.zst`...), a `.parquet` file (its
            `text_field` column), an fsspec URL of any of them (`s3://`, `https://`, ...); a
            folder of such files, a glob (`"data/*.parquet"`) or a list of `pathlib.Path`s,
            read in sorted (or list) order; a `ShardSet` or its folder (`write_shards` output,
            tar or Parquet: the `text_field` field or column; keyed on the index's sha256s,
            each shard checked against them as it is read); or a Hugging Face
            `datasets.Dataset` (its `text_field` column; not a dependency). A list of strings
            is always texts: one whose strings are all existing paths is refused.
        tokenizer: a `transformers` tokenizer (fast is best; a slow one works, with a warning).
        cache_dir: the cache folder; replaced atomically when rebuilt.
        max_length: truncate to this many tokens (special tokens included), as
            `tokenizer(..., truncation=True, max_length=...)` does.
        add_special_tokens: frame samples with the tokenizer's special tokens.
        text_field: the JSON field or column holding the text (`.jsonl`, `.parquet`, datasets).
        batch_size: texts per batch-encode call.
        progress: show a progress bar (on rank 0).
        distributed: split the batches over the ranks of the initialised process group, every
            rank of every node making the same call; None (the default): whenever a group of
            more than one rank is initialised; False: this process builds alone. Each node's
            folder (node-local or shared, found at run time) ends with the whole cache, the
            parts tokenized elsewhere received over the process group: byte-identical to a
            single-process build, each text tokenized once by the job.

    Returns:
        The opened `TokenCache`.

    Raises:
        ValueError: invalid UTF-8 (naming the file and line), a `.jsonl` line without
            `text_field` or not JSON (naming the line), an unknown file type, a folder or glob
            without text files, or a list of strings that are all existing paths.
        ShardIndexError, ShardFormatError: a shard set without a valid index, or a shard
            that differs from it.
    """
    from tqdm import tqdm

    if batch_size <= 0:
        raise ValueError(f"`batch_size` must be positive, but is {batch_size!r} instead.")
    if max_length is not None and max_length <= 0:
        raise ValueError(f"`max_length` must be positive, but is {max_length!r} instead.")
    if not getattr(tokenizer, "is_fast", False):
        warnings.warn(
            f"{type(tokenizer).__name__} is a slow (Python) tokenizer; building the cache will be "
            "much slower than with its fast (Rust) version.",
            stacklevel=2,
        )
    source = TextSource(texts, text_field=text_field)
    fingerprint = cache_fingerprint(
        source, tokenizer, max_length=max_length, add_special_tokens=add_special_tokens
    )
    target = Path(cache_dir)
    build = FolderBuild(target, distributed=distributed, inputs=fingerprint)
    if build.needed(lambda: TokenCache.open(target, fingerprint=fingerprint), TokenCacheError):
        dtype = np.dtype(_token_type(len(tokenizer))).newbyteorder("<")
        with (
            build,
            tqdm(disable=not progress or build.rank != 0, desc="tokenizing", unit="text") as bar,
        ):
            encode = batch_encoder(
                tokenizer, max_length=max_length, add_special_tokens=add_special_tokens
            )
            batches = source.batches(batch_size, part=build.rank, parts=build.world)
            write_part(batches, encode, build, dtype, bar)
            totals = build.gather(part_totals(build))
            count = sum(part.count for part in totals)
            num_tokens = sum(part.num_tokens for part in totals)
            build.collect("tokens.bin", "lengths.bin")  # every part complete, in every folder
            checksum = build.gather(algorithm())[0]
            files = None
            if build.leader:  # in each folder (node-local disks: one per node)
                join_parts(build, batch_size, dtype)
                offsets = np.fromfile(build.path / "offsets.bin", "<i8")
                write_item_sums(build.path, "tokens.bin", offsets * dtype.itemsize, checksum)
                files = file_checksums(build.path, ("offsets.bin", "checksums.bin"), checksum)
            build.publish(
                {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "fingerprint": fingerprint,
                    "checksum": checksum,
                    "file_checksums": files,
                    "count": int(count),
                    "num_tokens": int(num_tokens),
                    "dtype": dtype.name,
                    "max_length": max_length,
                    "add_special_tokens": add_special_tokens,
                    "vocab_size": len(tokenizer),
                    "tokenizer": type(tokenizer).__name__,
                    "source": source.describe(),
                }
            )
    return TokenCache.open(target, fingerprint=fingerprint)


def _token_type(vocab_size: int) -> type:
    """The smallest unsigned type that holds every token id: 2 bytes when it fits."""
    if vocab_size <= 2**16:
        return np.uint16
    return np.uint32
