"""MixtureIterable: a weighted interleave of iterable datasets, by the stop rules of
`MixtureSampler`, with fixed weights or a schedule, in samples or in tokens.

Use when: the sources are remote corpora read as `ShardedIterableDataset` shard sets (each
exact over ranks and workers by itself) and a map-style `ConcatDataset` is not possible.
Cost: per sample, one draw over the sources (`mixture_draws.py`) from a generator seeded by
`(seed, epoch, rank, worker)`; an elastic resume replays each old consumer's draws (arithmetic,
or reading its received samples again when shares are in tokens) and deals each source's rest
(`mixture_rest.py`).
Adapt here: `lengths=` (a sample's tokens); the draw rules are `mixture_draws.py`'s, the
weights' checks `mixture_weights.py`'s and `mixture_schedule.py`'s, the stop rules
`mixture_settings.py`'s.
Trade-off: each consumer paces itself, without talking to the others, so a schedule's progress
is each consumer's own count times the consumers (ranks x workers): consumers that read at
different rates drift apart on the schedule by their difference.
Copy with: common/resume/state_keys.py, common/resume/state_records.py,
  common/sampling/iterable_mixing/mixture_draws.py, common/sampling/iterable_mixing/mixture_rest.py,
  common/sampling/mixture_settings.py, common/sampling/mixture_weights.py,
  common/sampling/pacing/mixture_schedule.py, common/sampling/sharding.py.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from recipes.common.sampling.iterable_mixing.mixture_draws import (
    IidDraws,
    Interleave,
    PacedDraws,
    Progress,
    interleaved,
)
from recipes.common.sampling.iterable_mixing.mixture_rest import (
    Consumer,
    MixtureRest,
    ResumeAt,
    Shape,
    continued,
    rest_over,
)
from recipes.common.sampling.mixture_settings import check_count, check_stop
from recipes.common.sampling.mixture_weights import parse_sources
from recipes.common.sampling.pacing.mixture_schedule import Schedule
from recipes.common.sampling.sharding import distributed_world

SALT = 0x6974  # the draws' seed's last word (a resume's rest adds its generation)


class ItemLength:
    """A sample's tokens as `len(item[key])` (picklable, unlike a lambda)."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, item) -> int:
        return len(item[self.key])

    def __repr__(self) -> str:
        return f"ItemLength({self.key!r})"


class MixtureIterable(IterableDataset):
    """A weighted interleave of iterable datasets (`ShardedIterableDataset` shard sets), each
    split exactly over ranks and workers by itself.

    Fixed weights in samples (no `lengths`): in each worker of each rank, the next sample comes
    from a source drawn with probability proportional to its weight among the sources still
    yielding, from a generator seeded by `(seed, epoch, rank, worker)`. A `Schedule`, or
    `lengths`: the source furthest behind its share (of samples, or of tokens with `lengths`)
    comes next (`mixture_draws.PacedDraws`), so each worker holds the shares within about one
    sample's length at all times. A schedule's progress is this worker's own samples (or
    tokens) times the ranks x workers, after `epoch x epoch_length` (an approximation: workers
    that read at different rates drift apart on the schedule by their difference). A source a
    schedule weighs 0 waits: under "drop_exhausted" it is read once the weighted ones have ended
    (every sample of the epoch once), where a fixed weight of 0 never draws its source.

    Args:
        datasets: iterable datasets (a sequence, or a mapping from name to dataset); each is
            set to the mixture's epoch.
        weights: per source, as `datasets`; or a `Schedule` (weights over training progress),
            checked against the sources' names here.
        stop: "drop_exhausted" (every sample of every source once per epoch: equal counts per
            rank when every source is `even`), "first_exhausted" and
            "cycle_until_all_exhausted" (a source that ends starts again until every source
            has ended once; both one rank only: ranks would stop at different steps) or
            "never" (a source that ends starts again, in the same order within the epoch;
            needs `num_samples`).
        num_samples: the epoch's length: `ceil(num_samples / ranks)` per rank, cut over its
            workers.
        seed: the base seed.
        lengths: a sample's tokens, `lengths(item) -> int` (picklable: workers receive it), or
            a key whose value's `len` counts them (`"input_ids"`); the shares are then shares
            of tokens. Needed by a schedule `over="tokens"`.
        epoch_length: the schedule's units (samples or tokens) in one epoch, which place each
            epoch on the schedule (epoch e starts at `e x epoch_length`). Default, in samples:
            `num_samples`, else the sources' samples (`shard_lengths`); in tokens it must be
            given.

    Resume: with stop="drop_exhausted", no `num_samples` and sources that `reshape`
    (`ShardedIterableDataset`s with `shard_lengths`), a loader resumes it on any number of
    ranks and workers (`resume_after`), every sample of the epoch once over all the runs: each
    old consumer's draws are replayed to count what it received of each source (arithmetic; in
    tokens, by reading its received samples again), and each source's rest is dealt over the
    new shape, drawn from by a generator seeded with the rest's generation, so the rest's
    interleave is not an uninterrupted run's (its samples are). On the same shape, the epoch
    goes on exactly as it would have. Other settings resume by reading the epoch's first
    batches again, on the same ranks and workers (`resume_after` is None).

    Raises:
        ValueError: mismatched weights, a schedule naming an unknown source or without a
            positive weight at some point, an unknown `stop`, "never" without `num_samples`,
            "first_exhausted" or "cycle_until_all_exhausted" on several ranks, a token schedule
            without `lengths` or `epoch_length`.
    """

    def __init__(
        self,
        datasets,
        weights,
        *,
        stop: str = "drop_exhausted",
        num_samples: int | None = None,
        seed: int = 0,
        lengths: Callable[[Any], int] | str | None = None,
        epoch_length: int | None = None,
    ):
        self.schedule = None
        if isinstance(weights, Schedule):
            sources = parse_sources(datasets, _even(datasets), "datasets")
            self.schedule = weights.bind(sources.names)
        else:
            sources = parse_sources(datasets, weights, "datasets")
        self.names = sources.names
        self.datasets = sources.values
        self.weights = sources.weights
        check_stop(stop, num_samples)
        self.stop = stop
        self.num_samples = check_count("num_samples", num_samples)
        self.seed = check_count("seed", seed, minimum=0)
        self.lengths = lengths
        if isinstance(lengths, str):
            self.lengths = ItemLength(lengths)
        self.epoch_length = self._epoch_length(epoch_length)
        self.world_size = int(getattr(self.datasets[0], "world_size", distributed_world()[0]))
        self.rank = int(getattr(self.datasets[0], "rank", distributed_world()[1]))
        if stop in ("first_exhausted", "cycle_until_all_exhausted") and self.world_size > 1:
            raise ValueError(
                f"stop={stop!r} ends each rank's stream at a different step, and DDP would wait on "
                "the ranks that ended; use 'drop_exhausted' with even sources, or 'never' with "
                "num_samples."
            )
        if not self.reshapes:  # the loader reads the epoch's first batches again instead
            self.resume_after = None
        # in shared memory: reaches persistent workers
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._rest: MixtureRest | None = None  # an interrupted epoch's rest (`resume_after`)
        self._resume: ResumeAt | None = None  # where this shape stopped within it

    def _epoch_length(self, given: int | None) -> int | None:
        """`epoch_length`, checked; derived in samples where the sources tell their lengths."""
        given = check_count("epoch_length", given)
        if given is not None or self.schedule is None:
            return given
        if self.schedule.over == "tokens":
            if self.lengths is None:
                raise ValueError(
                    "A schedule over='tokens' needs `lengths=` (a sample's tokens: a function "
                    "of the sample, or a key such as 'input_ids')."
                )
            raise ValueError(
                "A schedule over='tokens' needs `epoch_length=`, the tokens of one epoch (it "
                "places each epoch on the schedule)."
            )
        if self.num_samples is not None:
            return self.num_samples
        counts = [_samples_of(d) for d in self.datasets]
        if None in counts:
            raise ValueError(
                "A schedule needs `epoch_length=` (the samples of one epoch, to place each epoch "
                "on it) when a source does not tell its length (`shard_lengths` or `len`)."
            )
        return int(sum(counts))

    @property
    def paced(self) -> bool:
        """Whether the next source is the one furthest behind its share (a schedule, or shares
        in tokens), rather than drawn at random."""
        return self.schedule is not None or self.lengths is not None

    @property
    def usable(self) -> np.ndarray:
        """The sources that may be drawn at all: with fixed weights, those above 0."""
        if self.schedule is not None:
            return np.ones(len(self.datasets), dtype=bool)
        return self.weights > 0

    @property
    def reshapes(self) -> bool:
        """Whether a resume counts what each consumer received and deals the rest over the new
        ranks and workers (any shape): "drop_exhausted", no `num_samples`, and sources that
        `reshape` and tell their consumers' samples (`ShardedIterableDataset.resume_consumed`).
        """
        return (
            self.stop == "drop_exhausted"
            and self.num_samples is None
            and all(
                getattr(d, "reshapes", False) and hasattr(d, "resume_consumed")
                for d in self.datasets
            )
        )

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (in shared memory: persistent workers see it), for the sources too."""
        self._epoch.fill_(int(epoch))
        for dataset in self.datasets:
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)

    def epoch_start(self) -> float:
        """The schedule's progress at this epoch's start (0 without a schedule)."""
        if self.schedule is None:
            return 0.0
        return float(self.epoch * self.epoch_length)

    def plan_settings(self) -> dict:
        """What shapes the stream, for the loader's state check (the ranks too, unless a resume
        may change them)."""
        sources = [getattr(d, "plan_settings", dict)() for d in self.datasets]
        settings = {
            "sources": sources,
            "weights": f"{zlib.crc32(self.weights.tobytes()):08x}",
            "stop": self.stop,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }
        if self.schedule is not None:
            settings["weights"] = self.schedule.fingerprint()
            settings["epoch_length"] = self.epoch_length
        if self.lengths is not None:
            settings["lengths"] = repr(self.lengths)
        if not self.reshapes:
            settings["world_size"] = self.world_size
        return settings

    def draws_for(self, consumer: Consumer, generation: int, start: float):
        """The draws of one consumer: seeded by `(seed, epoch, rank, worker)` (and a rest's
        generation); paced from `start` on the schedule, or drawn at random."""
        words = [self.seed, self.epoch, consumer.rank, consumer.worker, SALT]
        if generation:
            words.append(generation)
        rng = np.random.default_rng(words)
        if not self.paced:
            return IidDraws(self.weights, rng)
        weights_at = _Fixed(self.weights).weights_at
        tokens = self.lengths is not None
        if self.schedule is not None:
            weights_at = self.schedule.weights_at
            tokens = self.schedule.over == "tokens"
        progress = Progress(start, consumer.ranks * consumer.workers, tokens)
        return PacedDraws(weights_at, rng, progress, self.usable)

    def rule(self, draws, restart: Callable[[int], Iterator] | None = None) -> Interleave:
        """How a consumer interleaves its sources with `draws`."""
        if restart is None:
            restart = _no_restart
        return Interleave(draws, self.stop, self.lengths, restart)

    def resume_after(
        self,
        batches_done: int,
        *,
        batch_size: int | None,
        drop_last: bool = False,
        num_workers: int = 0,
        interleave: bool = False,
        world_size: int | None = None,
        reshaped: Sequence[Sequence[int]] | None = None,
    ) -> MixtureIterable:
        """A copy whose next epoch starts after the first `batches_done` batches that a
        DataLoader with these settings yielded on this shape, after the epoch's earlier shapes
        `reshaped` (`(ranks, workers, batches each rank received, nodes)`, oldest first), whose
        rest is dealt over this shape (`mixture_rest.py`). `interleave`: the rest of this shape
        in one process, as whole batches in the old workers' order (another worker count).

        Raises:
            ValueError: another number of ranks without `reshaped` (a state saved by a loader
                that did not deal the rest).
        """
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"MixtureIterable deals an epoch's rest over new ranks ({world_size} -> "
                f"{self.world_size}) only from the loader's earlier shapes (`reshaped`); "
                "resume with make_loader's StatefulLoader."
            )
        shapes = [Shape.of(shape) for shape in reshaped or []]
        resumed = copy.copy(self)
        resumed._rest = rest_over(self, shapes, batch_size, drop_last)
        resumed._resume = None
        if batches_done or interleave:
            resumed._resume = ResumeAt(
                int(batches_done), batch_size, bool(drop_last), max(1, int(num_workers)), interleave
            )
        return resumed

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker = 0
        workers = 1
        if info is not None:
            worker = info.id
            workers = info.num_workers
        consumer = Consumer(self.rank, self.world_size, worker, workers)
        if self._rest is not None and self._rest.epoch == self.epoch:
            yield from continued(self, self._rest, consumer, self._resume)
            return
        iterators = [iter(d) for d in self.datasets]
        draws = self.draws_for(consumer, 0, self.epoch_start())
        rule = self.rule(draws, lambda s: iter(self.datasets[s]))
        stream = interleaved(iterators, self.usable.copy(), rule)
        share = None
        if self.num_samples is not None:  # equal per rank (rounded up), then this worker's part
            per_rank = -(-self.num_samples // self.world_size)
            share = per_rank // workers + (worker < per_rank % workers)
        if share == 0:
            return
        for yielded, (_, item) in enumerate(stream, start=1):
            yield item
            if yielded == share:
                return

    def __repr__(self) -> str:
        if self.schedule is not None:
            return f"MixtureIterable({self.schedule.schedule!r}, stop={self.stop!r})"
        weights = dict(zip(self.names, np.round(self.weights, 3).tolist(), strict=True))
        return f"MixtureIterable({weights}, stop={self.stop!r})"


class _Fixed:
    """Fixed weights as a schedule's `weights_at`."""

    def __init__(self, weights: np.ndarray):
        self.weights = weights

    def weights_at(self, progress: float) -> np.ndarray:
        return self.weights[None, :]


def _no_restart(source: int) -> Iterator:
    return iter(())


def _even(datasets) -> Mapping | list:
    """Weights of 1 for every source (a schedule's sources are named by them)."""
    if isinstance(datasets, Mapping):
        return dict.fromkeys(datasets, 1.0)
    return [1.0] * len(datasets)


def _samples_of(dataset) -> int | None:
    """A source's samples per epoch, where it tells them (`shard_lengths`, `len`)."""
    lengths = getattr(dataset, "shard_lengths", None)
    if lengths is not None:
        return int(np.sum(lengths))
    try:
        return len(dataset)
    except TypeError:
        return None
