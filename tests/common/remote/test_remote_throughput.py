"""A small `recipes bench remote` in the default run, with conservative ratios."""

import numpy as np
import pytest

from recipes.bench.remote import RECORD_BYTES, compare


@pytest.mark.slow  # a long run (7 s) over HTTP; the S3 comparison runs in the fast tier
def test_prefetching_beats_simplecache_and_warm_epochs_approach_local_disk(tmp_path):
    per_shard = 64  # 512 KiB shards
    rng = np.random.default_rng(0)
    for s in range(6):
        (tmp_path / f"shard-{s:04d}.bin").write_bytes(
            rng.integers(0, 256, per_shard * RECORD_BYTES, np.uint8).tobytes()
        )
    rows, _ = compare(tmp_path, per_shard, latency=0.02, bandwidth_mb=4.0, prefetch=4, workers=1)
    streaming, simple, first, second, local = (row.items_per_s for row in rows)
    assert all(row.items == 6 * per_shard for row in rows)
    assert first >= 1.5 * simple, rows
    assert second >= 0.5 * local, rows


@pytest.mark.slow  # a long run (6.5 s): in the full suite (CI); the default run keeps headroom
def test_over_s3_prefetching_beats_simplecache_over_the_whole_epoch(tmp_path):
    """`recipes bench remote --s3` in small: moto's S3 server behind the throttling proxy."""
    per_shard = 48  # 384 KiB shards
    rng = np.random.default_rng(1)
    for s in range(4):
        (tmp_path / f"shard-{s:04d}.bin").write_bytes(
            rng.integers(0, 256, per_shard * RECORD_BYTES, np.uint8).tobytes()
        )
    rows, level = compare(
        tmp_path,
        per_shard,
        latency=0.02,
        bandwidth_mb=4.0,
        prefetch=4,
        workers=1,
        s3=True,
        repeat=1,
    )
    streaming, simple, first, second, local = rows
    assert all(row.items == 4 * per_shard for row in rows)
    whole = [row.items / row.seconds for row in rows]
    assert first.items_per_s >= 1.5 * simple.items_per_s, rows
    assert whole[2] >= 1.2 * whole[1], rows
    assert level["objects"] == 4
