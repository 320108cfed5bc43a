"""The worker count and worker start of every benchmark's DataLoaders, chosen once.

Use when: a benchmark takes `--workers` (default: `smart_num_workers()`) and hands its loaders
the library's `worker_init` whenever they start workers.
Cost: none beyond `smart_num_workers()`'s reading of the machine.
Adapt here: the default worker count of every `recipes bench` table.
Trade-off: one rule for every table, so their rows stay comparable; a table that needs another
count takes `--workers`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from recipes.common import smart_num_workers, worker_init


def chosen_workers(requested: int | None) -> int:
    """`--workers` as given, or `smart_num_workers()` when it was left out."""
    if requested is None:
        return smart_num_workers()
    return requested


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says it), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_init_for(workers: int) -> Callable[[int], None] | None:
    """`worker_init` for a DataLoader with workers; None (nothing to start) without."""
    if workers:
        return worker_init
    return None


def workers_override(requested: int | None) -> dict:
    """`make_loader`'s `num_workers=` when `--workers` was given; nothing (its own choice)
    when it was left out."""
    if requested is None:
        return {}
    return {"num_workers": requested}
