"""MixtureSampler: weighted sampling across datasets, exact under DDP and on resume.

Use when: training draws from several sources at set proportions (web text, code and books for a
language model; several speech corpora; several image sets) through one
`torch.utils.data.ConcatDataset(datasets)`. Each epoch's plan is drawn from `(seed, epoch)`:
at every position a source is chosen with probability proportional to its weight among the
sources still drawing, and the source gives its next index from a fresh permutation of its
own (no index repeats within a source before the source is exhausted).
Cost: per epoch, one vectorised draw of the plan (an int64 array of the epoch's length, the
same on every rank), cached for the epoch; per index, nothing.
Adapt here: `STOPS` (`mixture_settings.py`); the draw itself in `mixture_plan.py`.
Trade-off: the plan is a function of `(seed, epoch)` and the settings, so the loader's state
is the epoch and the batches received (O(1), never O(samples)); a resume regenerates it.
`stop` decides what a source that runs out does, each rule named for what it does (the
names of Hugging Face `datasets` and torchdata in brackets):
- "drop_exhausted" (default): it leaves the draw (the others' weights renormalise); the epoch
  ends when every source is exhausted: every sample of every source exactly once per epoch,
  the proportions holding while all sources still draw (torchdata `ALL_DATASETS_EXHAUSTED`);
- "first_exhausted": the epoch ends with the first source's last sample (HF
  `first_exhausted`, torchdata `FIRST_DATASET_EXHAUSTED`);
- "cycle_until_all_exhausted": it starts a fresh permutation, and the epoch ends with the
  last source's last sample of its first pass: the proportions hold throughout and every
  sample is seen at least once (HF `all_exhausted`, torchdata
  `CYCLE_UNTIL_ALL_DATASETS_EXHAUSTED`); a source of small weight makes the epoch long;
- "never": it starts a fresh permutation; the epoch's length is `num_samples` (required),
  and the proportions hold throughout (a small source repeats, each pass a new permutation).
`num_samples` also caps the other rules (Streaming's `epoch_size`). "all_exhausted" is
refused: HF's meaning (cycle) and this library's former one (drop) differ, so the rule must
be named.
DDP: the global plan is padded to a multiple of the ranks by repeating its first indices (at
most `num_replicas - 1`, as `DistributedSampler`) and rank r takes positions r, r + R, ...:
disjoint, equal counts; `state_dict(samples_done=)` resumes on another number of ranks
(elastic: the plan's rest dealt over the new ranks, as `ElasticDistributedSampler`). With
`batch_size`, it is a batch sampler instead: global batches of the plan dealt round-robin, and
`state_dict(batches_done=)` resumes on another number of ranks, as `LengthBucketSampler`.
Rooms: the weights in `mixture_weights.py`, the epoch's plan in `mixture_plan.py`, the state's
keys in `mixture_state.py`, the sources' batch reads in `mixture_sources.py` (`MixtureSources`).
`MixtureIterable` (`mixture_iterable.py`) interleaves iterable datasets (`ShardedIterableDataset`
shard sets, each exact over ranks and workers) by the same weights and stop rules, for remote
corpora.
Copy with: common/sampling/mixture_plan.py, common/sampling/mixture_settings.py,
  common/sampling/mixture_state.py, common/sampling/mixture_weights.py, common/sampling/sharding.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from recipes.common.sampling.mixture_plan import EpochPlan, MixturePlan
from recipes.common.sampling.mixture_settings import check_count, check_stop
from recipes.common.sampling.mixture_state import MixturePosition, read_state, write_state
from recipes.common.sampling.mixture_weights import parse_sources
from recipes.common.sampling.sharding import distributed_world


class MixtureSampler:
    """Indices into `ConcatDataset(datasets)` drawn across sources by weight.

    Args:
        sizes: samples per source, a sequence or a mapping from name to size (in the
            `ConcatDataset`'s order).
        weights: per source, the same shape as `sizes` (normalised; need not sum to 1).
        num_samples: the epoch's length (all ranks together); required with stop="never".
        stop: "drop_exhausted", "first_exhausted", "cycle_until_all_exhausted" or "never"
            (see the module docstring).
        seed: the base seed, the same on every rank.
        num_replicas, rank: the ranks; `torch.distributed`'s when initialised, else 1 and 0.
        shuffle: permute each source's indices (in order when False; sources still mix).
        batch_size: yield batches (lists) of this size instead of indices: a batch sampler,
            elastic on resume. `drop_last` drops the plan's last partial batch.

    Raises:
        ValueError: mismatched or non-positive sizes or weights (or weights whose sum
            overflows), an unknown or ambiguous `stop`, stop="never" without `num_samples`,
            or a "cycle_until_all_exhausted" epoch of over `MAX_CYCLED` samples.

    Example:
        >>> mix = MixtureSampler({"web": len(web), "code": len(code)}, {"web": 0.7, "code": 0.3})
        >>> loader = make_loader(ConcatDataset([web, code]), batch_size=32, sampler=mix)
    """

    def __init__(
        self,
        sizes: Sequence[int] | Mapping[str, int],
        weights: Sequence[float] | Mapping[str, float],
        *,
        num_samples: int | None = None,
        stop: str = "drop_exhausted",
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        batch_size: int | None = None,
        drop_last: bool = False,
    ):
        sources = parse_sources(sizes, weights, "sizes")
        self.names = sources.names
        self.weights = sources.weights
        self.sizes = _whole_sizes(sources.values, self.names)
        check_stop(stop, num_samples)
        self.num_samples = check_count("num_samples", num_samples)
        self.batch_size = check_count("batch_size", batch_size)
        self.seed = int(check_count("seed", seed, minimum=0))
        self.stop = stop
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._planner = MixturePlan(
            self.sizes,
            self.weights,
            stop=stop,
            num_samples=self.num_samples,
            seed=self.seed,
            shuffle=shuffle,
        )
        self._planner.check_length()
        self.offsets = self._planner.offsets
        world, here = distributed_world()
        if num_replicas is None:
            num_replicas = world
        if rank is None:
            rank = here
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"`rank` must be in [0, {self.num_replicas}), but is {self.rank!r} instead."
            )
        self.epoch = 0
        # positions of the plan done before this pass (a loaded state; batch mode: global
        # batches, as LengthBucketSampler)
        self._start = 0
        self._begin = 0  # where the current pass began
        self._yielded = 0  # batch mode: local batches yielded in the current pass
        self._cache: EpochPlan | None = None

    # ---- the epoch's plan, dealt over the ranks -------------------------------------------
    def global_indices(self, epoch: int | None = None) -> np.ndarray:
        """Every index of `epoch`'s plan (all ranks), in order: the same on every rank."""
        if epoch is None:
            epoch = self.epoch
        epoch = int(epoch)
        if self._cache is None or self._cache.epoch != epoch:
            self._cache = self._planner.draw(epoch)
        return self._cache.indices

    def _padded(self, epoch: int, start: int = 0) -> np.ndarray:
        """The plan's rest from position `start`, padded with its first indices to a multiple
        of the ranks."""
        plan = self.global_indices(epoch)
        rest = plan[min(start, len(plan)) :]
        r = self.num_replicas
        if len(rest) % r and len(plan):
            rest = np.concatenate([rest, plan[np.arange(r - len(rest) % r) % len(plan)]])
        return rest

    def _global_batches(self, epoch: int) -> list[np.ndarray]:
        plan = self.global_indices(epoch)
        b = self.batch_size
        batches = [plan[i : i + b] for i in range(0, len(plan), b)]
        if self.drop_last and batches and len(batches[-1]) < b:
            batches.pop()
        return batches

    def pass_batches(self) -> list[np.ndarray]:
        """This rank's batches of the current pass, from where it began (a resume's position)."""
        return self._batch_plan(self.epoch, self._begin)

    def _batch_plan(self, epoch: int, start: int) -> list[np.ndarray]:
        batches = self._global_batches(epoch)
        rest = batches[start:]
        r = self.num_replicas
        if len(rest) % r and batches:
            rest = rest + [batches[i % len(batches)] for i in range(r - len(rest) % r)]
        return rest[self.rank :: r]

    # ---- Sampler protocol ----------------------------------------------------------------
    def __iter__(self) -> Iterator:
        self._begin = self._start
        self._start = 0  # a resumed epoch continues only once
        if self.batch_size is None:
            yield from self._padded(self.epoch, self._begin)[
                self.rank :: self.num_replicas
            ].tolist()
            return
        plan = self._batch_plan(self.epoch, self._begin)
        self._yielded = 0
        for batch in plan:
            self._yielded += 1
            yield batch.tolist()

    def __len__(self) -> int:
        if self.batch_size is None:
            return len(self._padded(self.epoch, self._start)) // self.num_replicas
        return len(self._batch_plan(self.epoch, self._start))

    def set_epoch(self, epoch: int) -> None:
        """Draws `epoch`'s plan (call before each epoch, as with `DistributedSampler`); the epoch
        it is at already keeps a loaded position (Lightning sets it after `iter()`)."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._start = 0
            self._begin = 0
            self._yielded = 0

    # ---- what it drew ----------------------------------------------------------------------
    def source_of(self, indices) -> np.ndarray:
        """The source number of each `ConcatDataset` index."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def source_counts(self, samples_done: int | None = None, *, start: int = 0) -> dict[str, int]:
        """Samples per source among this rank's `samples_done` samples of the current pass from
        its `start`-th (all of them when None): the realised mixture, by name."""
        if self.batch_size is None:
            mine = self._padded(self.epoch, self._begin)[self.rank :: self.num_replicas]
        else:
            mine = np.concatenate(self._batch_plan(self.epoch, 0) or [np.empty(0, np.int64)])
        end = None
        if samples_done is not None:
            end = start + samples_done
        counts = np.bincount(self.source_of(mine[start:end]), minlength=len(self.sizes))
        return {name: int(c) for name, c in zip(self.names, counts, strict=True)}

    # ---- resume ----------------------------------------------------------------------------
    def plan_settings(self) -> dict:
        """Every setting that shapes the epoch's plan (JSON; not the ranks, which a resume may
        change)."""
        return {
            "sizes": self.sizes.tolist(),
            "weights": f"{zlib.crc32(self.weights.tobytes()):08x}",
            "num_samples": self.num_samples,
            "stop": self.stop,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def state_dict(
        self, *, batches_done: int | None = None, samples_done: int | None = None
    ) -> dict:
        """The epoch and the plan's positions done over all ranks (`load_state_dict` continues on
        any number of ranks): the global batches done after this rank's loop received
        `batches_done` batches (batch mode), or the samples done after `samples_done` samples
        (index mode); `make_loader`'s loader passes its counts itself."""
        begin = self._start or self._begin  # a pending resume, or where this pass began
        if self.batch_size is None:
            done = begin + int(samples_done or 0) * self.num_replicas
            total = len(self.global_indices(self.epoch))
        else:
            batches = self._yielded
            if batches_done is not None:
                batches = int(batches_done)
            done = begin + batches * self.num_replicas
            total = len(self._global_batches(self.epoch))
        position = MixturePosition(self.epoch, min(done, total))
        return write_state(position, self.plan_settings(), batch_mode=self.batch_size is not None)

    def load_state_dict(self, state: dict) -> None:
        """Continues the saved epoch (batch mode: on this sampler's number of ranks).

        Raises:
            ValueError: a state saved under other sources, weights or settings.
        """
        batch_mode = self.batch_size is not None
        position = read_state(state, self.plan_settings(), batch_mode=batch_mode)
        self.epoch = position.epoch
        self._start = position.done
        self._begin = 0
        self._yielded = 0

    def __repr__(self) -> str:
        mix = ", ".join(
            f"{n}: {w:.3f} of {s}"
            for n, w, s in zip(self.names, self.weights, self.sizes, strict=True)
        )
        return f"MixtureSampler({mix}; stop={self.stop!r}, num_samples={self.num_samples})"


def _whole_sizes(sizes: list, names: list[str]) -> np.ndarray:
    """`sizes` as int64, each a positive whole number.

    Raises:
        ValueError: a fractional size, or a source without samples (named).
    """
    raw = np.asarray(sizes)
    whole_floats = raw.dtype.kind == "f" and np.all(raw == np.floor(raw))
    if raw.dtype.kind not in "iu" and not whole_floats:
        raise ValueError(f"`sizes` must be whole numbers of samples, but are {raw.tolist()}.")
    out = raw.astype(np.int64)
    if (out <= 0).any():
        raise ValueError(
            f"every source needs samples; sizes are {out.tolist()} (source "
            f"{names[int(np.argmin(out))]!r})."
        )
    return out
