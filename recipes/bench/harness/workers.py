"""The worker count and worker start of every benchmark's DataLoaders, chosen once.

Use when: a benchmark takes `--workers` (default: `smart_num_workers()`) and hands its loaders
the library's `worker_init` whenever they start workers.
Cost: none beyond `smart_num_workers()`'s reading of the machine.
Adapt here: the default worker count of every `recipes bench` table.
Trade-off: one rule for every table, so their rows stay comparable; a table that needs another
count takes `--workers`.
"""

from __future__ import annotations

from collections.abc import Callable

from recipes.common import smart_num_workers, worker_init


def chosen_workers(requested: int | None) -> int:
    """`--workers` as given, or `smart_num_workers()` when it was left out."""
    if requested is None:
        return smart_num_workers()
    return requested


def worker_init_for(workers: int) -> Callable[[int], None] | None:
    """`worker_init` for a DataLoader with workers; None (nothing to start) without."""
    if workers:
        return worker_init
    return None
