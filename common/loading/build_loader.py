"""The DataLoader of a `build_*` pass: index order, and workers that die with their parent (a
killed build leaves no orphan decoding on) and are replaced when stuck in their fork.

Use when: a cache build reads its dataset through DataLoader workers.
Cost: none beyond DataLoader's.
Adapt here: the worker count's fallback when this file is copied without the package.
Trade-off: `num_workers=None` asks `smart_num_workers()` (cgroup quota, memory).
Copy with: common/loader_warning.py, common/workers/process_lifetime.py,
  common/workers/start_watch.py.
"""

from __future__ import annotations

import os

from torch.utils.data import DataLoader

from recipes.common.workers.process_lifetime import die_with_parent
from recipes.common.workers.start_watch import watched_iterator

try:
    from recipes.common.sizing.sizing import smart_num_workers
except ImportError:  # this file copied on its own
    smart_num_workers = None


def build_loader(dataset, *, num_workers: int | None, batch_size: int, collate_fn):
    """The DataLoader of a `build_*` pass, in index order. Its workers die with their parent
    (a killed build leaves no orphan decoding on). `num_workers=None`: `smart_num_workers()`
    (cgroup quota, memory), or for a file copied without the package the CPUs it may use."""
    if num_workers is None and smart_num_workers is None:  # this file copied on its own
        num_workers = max(0, min(len(os.sched_getaffinity(0)) - 1, 8))
    if num_workers is None:
        num_workers = smart_num_workers()
    if num_workers < 0:
        raise ValueError(f"`num_workers` must be non-negative, but is {num_workers!r} instead.")

    class BuildLoader(DataLoader):
        def _get_iterator(self):  # a worker stuck in its fork is replaced (start_watch.py)
            return watched_iterator(self, super()._get_iterator)

    worker_init_fn = None
    if num_workers:
        worker_init_fn = _build_worker_init
    return BuildLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate_fn,
        worker_init_fn=worker_init_fn,
    )


def _build_worker_init(worker_id: int) -> None:
    die_with_parent()
