"""The settings that shape a `ShardedIterableDataset` epoch's plan, as the JSON a loader state
carries (`plan_settings()`), with their keys named once.

Use when: a loader state records the dataset's plan so that a resume under other settings (other
shards, lengths, seed, mixing) is refused instead of reading another order; or you add a setting
that shapes the plan: name its key here.
Cost: a crc32 of the shard names and lengths, and of a `blocks` callable's cuts over every shard,
each computed once per dataset.
Adapt here: nothing; a new key is added here first.
Trade-off: shards and lengths are compared by checksum, not kept: a state stays small for a
million shards, at the cost of naming no shard when they differ.
Copy with: common/caches/packed_strings.py, common/shards/epochs/shard_mixing.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.shards.epochs.shard_mixing import INTERLEAVE, ORDER_VERSION, START

# The plan's keys.
NUM_SHARDS = "num_shards"
SHARDS = "shards"  # crc32 of the shard names
SHARD_LENGTHS = "shard_lengths"  # crc32 of the lengths, or None
SHARD_VERSIONS = "shard_versions"  # crc32 of the shards' versions (ETag, sha256), when given
SHUFFLE = "shuffle"
SEED = "seed"
EVEN = "even"
SPLIT = "split"  # only when not "auto": states saved before `split` existed still match "auto"
MIXING = "mixing"  # only when samples mix: states of shard-order reading do not match

# The mixing's keys (under MIXING).
ORDER = "order"  # shard_mixing.ORDER_VERSION
WINDOW = "window"
REACH_AT_START = "start"
INTERLEAVED_BLOCKS = "interleave"
BLOCKS = "blocks"


def shards_crc(shards: PackedStrings) -> str:
    """A checksum of the shard names, in order."""
    data = shards.data.tobytes() + shards.offsets.tobytes()
    return f"{zlib.crc32(data):08x}"


def versions_crc(versions: Sequence[str | None]) -> str:
    """A checksum of the shards' versions, in order (a shard rewritten under its name changes
    it)."""
    data = "\n".join(str(v) for v in versions).encode()
    return f"{zlib.crc32(data):08x}"


def lengths_crc(shard_lengths: np.ndarray | None) -> str | None:
    """A checksum of the samples per shard (None when unknown)."""
    if shard_lengths is None:
        return None
    return f"{zlib.crc32(shard_lengths.tobytes()):08x}"


def blocks_crc(blocks: Callable[[int], Sequence[int]], num_shards: int) -> str:
    """A `blocks` callable by a checksum of the cuts it gives for every shard (two callables that
    cut alike match, others do not)."""
    crc = 0
    for shard in range(num_shards):
        crc = zlib.crc32(np.asarray(blocks(shard), dtype=np.int64).tobytes(), crc)
    return f"{crc:08x}"


def mixing_settings(window: int, blocks: Any) -> dict:
    """The sample order's settings; `blocks` as it shapes the order (an int, None, or a
    callable's `blocks_crc`)."""
    return {
        ORDER: ORDER_VERSION,
        WINDOW: window,
        REACH_AT_START: START,
        INTERLEAVED_BLOCKS: INTERLEAVE,
        BLOCKS: blocks,
    }
