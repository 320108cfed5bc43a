"""MixtureIterable: a weighted interleave of iterable datasets, by the stop rules of
`MixtureSampler`.

Use when: the sources are remote corpora read as `ShardedIterableDataset` shard sets (each
exact over ranks and workers by itself) and a map-style `ConcatDataset` is not possible.
Cost: per sample, one weighted draw from a generator seeded by `(seed, epoch, rank, worker)`.
Adapt here: nothing; the weights and their checks are `mixture_weights.py`'s, the stop rules
`mixture_settings.py`'s.
Trade-off: the stream is a function of the epoch and the settings, so a loader resumes it
exactly by reading its prefix again (it has no `resume_after`), with the same numbers of
ranks and workers.
Copy with: common/sampling/mixture_settings.py, common/sampling/mixture_weights.py,
  common/sampling/sharding.py.
"""

from __future__ import annotations

import zlib

import numpy as np
from torch.utils.data import IterableDataset

from recipes.common.sampling.mixture_settings import check_count, check_stop
from recipes.common.sampling.mixture_weights import parse_sources
from recipes.common.sampling.sharding import distributed_world


class MixtureIterable(IterableDataset):
    """A weighted interleave of iterable datasets (`ShardedIterableDataset` shard sets), each
    split exactly over ranks and workers by itself.

    In each worker of each rank, the next sample comes from a source drawn with probability
    proportional to its weight among the sources still yielding, from a generator seeded by
    `(seed, epoch, rank, worker)`: the stream is a function of the epoch and the settings, so a
    loader resumes it exactly (by reading its prefix again: it has no `resume_after`).

    Args:
        datasets: iterable datasets (a sequence, or a mapping from name to dataset); each is
            set to the mixture's epoch.
        weights: per source, as `datasets`.
        stop: "drop_exhausted" (every sample of every source once per epoch: equal counts per
            rank when every source is `even`), "first_exhausted" and
            "cycle_until_all_exhausted" (a source that ends starts again until every source
            has ended once; both one rank only: ranks would stop at different steps) or
            "never" (a source that ends starts again, in the same order within the epoch;
            needs `num_samples`).
        num_samples: the epoch's length: `ceil(num_samples / ranks)` per rank, cut over its
            workers.

    The proportions hold per worker: give each source `shard_lengths` (sample ranges, so every
    worker reads from every source) or at least as many shards as ranks x workers; a source
    with fewer whole shards than workers is read by only some of them, which then draw it more
    and the others not at all. A resume needs the same number of ranks and workers (the
    stream is a function of both; another number is refused).
        seed: the base seed.

    Raises:
        ValueError: mismatched weights, an unknown `stop`, "never" without `num_samples`, or
            "first_exhausted" or "cycle_until_all_exhausted" on several ranks.
    """

    def __init__(
        self,
        datasets,
        weights,
        *,
        stop: str = "drop_exhausted",
        num_samples: int | None = None,
        seed: int = 0,
    ):
        sources = parse_sources(datasets, weights, "datasets")
        self.names = sources.names
        self.datasets = sources.values
        self.weights = sources.weights
        check_stop(stop, num_samples)
        self.stop = stop
        self.num_samples = check_count("num_samples", num_samples)
        self.seed = check_count("seed", seed, minimum=0)
        self.world_size = int(getattr(self.datasets[0], "world_size", distributed_world()[0]))
        self.rank = int(getattr(self.datasets[0], "rank", distributed_world()[1]))
        if stop in ("first_exhausted", "cycle_until_all_exhausted") and self.world_size > 1:
            raise ValueError(
                f"stop={stop!r} ends each rank's stream at a different step, and DDP would wait on "
                "the ranks that ended; use 'drop_exhausted' with even sources, or 'never' with "
                "num_samples."
            )
        import torch

        self._epoch = torch.zeros(
            1, dtype=torch.int64
        ).share_memory_()  # reaches persistent workers

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (in shared memory: persistent workers see it), for the sources too."""
        self._epoch.fill_(int(epoch))
        for dataset in self.datasets:
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)

    def plan_settings(self) -> dict:
        """What shapes the stream, for the loader's state check."""
        sources = [getattr(d, "plan_settings", dict)() for d in self.datasets]
        return {
            "sources": sources,
            "weights": f"{zlib.crc32(self.weights.tobytes()):08x}",
            "stop": self.stop,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "world_size": self.world_size,
        }

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = 0
        workers = 1
        if info is not None:
            worker = info.id
            workers = info.num_workers
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, 0x6974])
        share = None
        if (
            self.num_samples is not None
        ):  # equal per rank (rounded up), then this worker's part of it
            per_rank = -(-self.num_samples // self.world_size)
            share = per_rank // workers + (worker < per_rank % workers)
        iterators = [iter(d) for d in self.datasets]
        active = self.weights > 0
        ended = ~active  # "cycle_until_all_exhausted": the sources that have ended once
        yielded = 0
        while active.any() and (share is None or yielded < share):
            p = np.where(active, self.weights, 0.0)
            s = int(rng.choice(len(p), p=p / p.sum()))
            item = next(iterators[s], _END)
            if item is _END:
                if self.stop == "first_exhausted":
                    return
                ended[s] = True
                if self.stop == "cycle_until_all_exhausted" and ended.all():
                    return
                if self.stop in ("never", "cycle_until_all_exhausted"):
                    iterators[s] = iter(self.datasets[s])
                    item = next(iterators[s], _END)
                if item is _END:
                    active[s] = False
                    continue
            yield item
            yielded += 1

    def __repr__(self) -> str:
        weights = dict(zip(self.names, np.round(self.weights, 3).tolist(), strict=True))
        return f"MixtureIterable({weights}, stop={self.stop!r})"


_END = object()
