"""A small `recipes bench audio` in the default run, with conservative ratios."""

import pytest

from recipes.bench.audio import compare
from recipes.testing import make_audio_files


@pytest.mark.slow  # a long run (6.5 s): in the full suite (CI); the default run keeps headroom
def test_chunked_and_cached_beat_whole_file_loading(tmp_path):
    make_audio_files(tmp_path / "long", count=2, seconds=90.0, seed=5)
    rows, _, count = compare(
        tmp_path / "long", chunk_seconds=4.0, batch_size=8, workers=1, baseline_items=16
    )
    baseline, chunked, cached, threads = (row.items_per_s for row in rows)
    assert count == 46 and rows[1].items == rows[2].items == rows[3].items == count
    assert chunked >= 3 * baseline, rows
    assert cached >= 10 * baseline, rows
    assert threads >= 1.5 * cached, rows  # issue 21's target: the thread path
