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
  common/sampling/mixture_shares.py, common/sampling/mixture_state.py,
  common/sampling/mixture_weights.py, common/sampling/pacing/mixture_changes.py,
  common/sampling/pacing/mixture_epoch.py, common/sampling/pacing/mixture_pacing.py,
  common/sampling/pacing/mixture_schedule.py, common/sampling/sharding.py.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from recipes.common.sampling.mixture_plan import MixturePlan
from recipes.common.sampling.mixture_settings import (
    check_count,
    check_stop,
    source_lengths,
    whole_sizes,
)
from recipes.common.sampling.mixture_shares import POINTS, WINDOW, ShareTrace, share_trace
from recipes.common.sampling.mixture_state import (
    MixturePosition,
    read_segments,
    read_state,
    write_state,
)
from recipes.common.sampling.pacing.mixture_changes import (
    agree,
    check_holdable,
    held_error,
    parsed_change,
)
from recipes.common.sampling.pacing.mixture_epoch import EpochDraws
from recipes.common.sampling.pacing.mixture_schedule import Schedule, scheduled_sources
from recipes.common.sampling.sharding import checked_ranks

# Index mode hands this rank's indices out in chunks of this many (a change of weights takes
# effect after the chunks handed out).
CHUNK = 64


class _View(NamedTuple):
    """This rank's part of a pass, as the iterator hands it out."""

    key: tuple
    """(epoch, where the pass began, the plan's version): a redraw makes a new view."""
    part: list | np.ndarray
    """This rank's batches (batch mode) or indices."""


class MixtureSampler:
    """Indices into `ConcatDataset(datasets)` drawn across sources by weight.

    Args:
        sizes: samples per source, a sequence or a mapping from name to size (in the
            `ConcatDataset`'s order).
        weights: per source, the same shape as `sizes` (normalised; need not sum to 1), or a
            `Schedule` (weights over training progress).
        lengths: each sample's length in tokens (one array per source, a mapping by name, or
            one array over all sources in order): the weights are then shares of tokens.
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
            overflows), lengths that do not match the sizes (or a source of only 0-length
            samples), a schedule over tokens without lengths (or over samples with them), an
            unknown or ambiguous `stop`, stop="never" without `num_samples`, or a
            "cycle_until_all_exhausted" epoch of over `MAX_CYCLED` samples.

    Example:
        >>> mix = MixtureSampler({"web": len(web), "code": len(code)}, {"web": 0.7, "code": 0.3})
        >>> loader = make_loader(ConcatDataset([web, code]), batch_size=32, sampler=mix)
    """

    def __init__(
        self,
        sizes: Sequence[int] | Mapping[str, int],
        weights: Sequence[float] | Mapping[str, float] | Schedule,
        *,
        lengths=None,
        num_samples: int | None = None,
        stop: str = "drop_exhausted",
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        batch_size: int | None = None,
        drop_last: bool = False,
    ):
        sources, self.schedule = scheduled_sources(sizes, weights, "sizes")
        self.names = sources.names
        self.weights = sources.weights
        self.sizes = whole_sizes(sources.values, self.names)
        lengths = source_lengths(lengths, self.sizes, self.names)
        if self.schedule is not None:
            self.schedule.check_lengths(lengths is not None)
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
        self.lengths = None
        if lengths is not None:
            self.lengths = np.concatenate(lengths)
        self.paced = self.schedule is not None or lengths is not None
        self._draws = EpochDraws.build(self._planner, lengths, self.schedule)
        self.num_replicas, self.rank = checked_ranks(num_replicas, rank)
        self.epoch = 0
        # positions of the plan done before this pass (a loaded state; batch mode: global
        # batches, as LengthBucketSampler)
        self._start = 0
        self._begin = 0  # where the current pass began
        self._yielded = 0  # batch mode: local batches yielded in the current pass
        self._handed = 0  # this pass's batches (or indices) handed out by the iterator
        self._lock = threading.Lock()  # the iterator and `set_weights` on another thread
        self._version = 0  # counts the plan's redraws: a change of weights, a resume
        self._view: _View | None = None
        self._other: EpochDraws | None = None  # the last other epoch's draws asked for
        self._held_by: str | None = None  # the sampler that buckets or packs this plan

    # ---- the epoch's plan, dealt over the ranks -------------------------------------------
    def global_indices(self, epoch: int | None = None) -> np.ndarray:
        """Every index of `epoch`'s plan (all ranks), in order: the same on every rank. After a
        resume into an epoch whose weights the loop changed, from the first position the state
        holds (`known_from()`)."""
        return self._epoch(epoch).indices

    def known_from(self, epoch: int | None = None) -> int:
        """The first position of `epoch`'s plan this sampler knows (0 unless resumed)."""
        return self._epoch(epoch).first

    def _epoch(self, epoch: int | None) -> EpochDraws:
        """The draws of `epoch`: the current epoch's own, another's drawn on a copy."""
        if epoch is None:
            epoch = self.epoch
        epoch = int(epoch)
        if self._draws.epoch != self.epoch:
            self._draws.advance(self.epoch)
        if epoch == self.epoch:
            return self._draws
        self._other = self._draws.other(epoch, self._other)
        return self._other

    def _padded(self, epoch: int, start: int = 0) -> np.ndarray:
        """The plan's rest from position `start`, padded with its first known indices to a
        multiple of the ranks."""
        draws = self._epoch(epoch)
        plan = draws.indices
        rest = plan[min(max(start - draws.first, 0), len(plan)) :]
        r = self.num_replicas
        if len(rest) % r and len(plan):
            rest = np.concatenate([rest, plan[np.arange(r - len(rest) % r) % len(plan)]])
        return rest

    def _global_batches(self, epoch: int) -> list[np.ndarray]:
        """The known global batches of `epoch` (from batch `known_from(epoch) // batch_size`)."""
        plan = self._epoch(epoch).indices
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
        first = self.known_from(epoch) // self.batch_size
        rest = batches[max(start - first, 0) :]
        r = self.num_replicas
        if len(rest) % r and batches:
            rest = rest + [batches[i % len(batches)] for i in range(r - len(rest) % r)]
        return rest[self.rank :: r]

    # ---- Sampler protocol ----------------------------------------------------------------
    def __iter__(self) -> Iterator:
        self._begin = self._start
        self._start = 0  # a resumed epoch continues only once
        self._yielded = 0
        self._handed = 0
        epoch = self.epoch
        while True:
            with self._lock:  # `set_weights` redraws only what was not handed out
                chunk = self._chunk(epoch)
            if chunk is None:
                return
            if self.batch_size is None:
                yield from chunk
            else:
                self._yielded += 1
                yield chunk

    def _chunk(self, epoch: int) -> list | None:
        """The next batch (batch mode) or up to `CHUNK` indices of this rank's pass, or None."""
        key = (epoch, self._begin, self._version)
        if self._view is None or self._view.key != key:
            if self.batch_size is None:
                part = self._padded(epoch, self._begin)[self.rank :: self.num_replicas]
            else:
                part = self._batch_plan(epoch, self._begin)
            self._view = _View(key, part)
        part = self._view.part
        if self._handed >= len(part):
            return None
        if self.batch_size is not None:
            self._handed += 1
            return part[self._handed - 1].tolist()
        chunk = part[self._handed : self._handed + CHUNK].tolist()
        self._handed += len(chunk)
        return chunk

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
            self._handed = 0

    # ---- weights set by the training loop ----------------------------------------------------
    def set_weights(self, weights: Sequence[float] | Mapping[str, float]) -> int:
        """Changes the weights from the next global position that no rank has drawn (the
        loader reads ahead), for the rest of this epoch and the next ones (a schedule no
        longer applies). Call it on every rank at the same step, with the same weights:
        under `torch.distributed` the ranks compare a checksum and agree on the position.

        Returns:
            The global position where the weights take effect (samples over all ranks; global
            batches in batch mode), recorded in the state: a resume replays the same draws.

        Raises:
            ValueError: unknown sources or invalid weights; a mixture bucketed or packed by
                `LengthBucketSampler(mixture=)` / `PackedBatchSampler(mixture=)`; on every rank,
                ranks that passed other weights than rank 0 (named).
        """
        if self._held_by is not None:
            raise held_error(self._held_by)
        new = parsed_change(self.names, weights)
        with self._lock:
            mine = max(self._start, self._begin + self._handed * self.num_replicas)
            agreed = agree(new, mine, self.num_replicas)
            self._epoch(self.epoch).change(agreed.position * (self.batch_size or 1), new)
            self._version += 1
            self._other = None  # later epochs carry the new weights
        return agreed.position

    def hold_weights(self, holder: str) -> None:
        """Marks this plan as read whole by `holder` (a `LengthBucketSampler` or
        `PackedBatchSampler`): `set_weights` is refused from now on (`check_holdable`)."""
        check_holdable(self._draws, holder)
        self._held_by = holder

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

    def share_trace(
        self, epoch: int | None = None, *, window: int = WINDOW, points: int = POINTS
    ) -> ShareTrace:
        """Realised shares of `epoch`'s plan in sliding windows against the weights in force
        (`mixture_shares.share_trace`)."""
        return share_trace(self, epoch, window=window, points=points)

    # ---- resume ----------------------------------------------------------------------------
    def plan_settings(self) -> dict:
        """Every setting that shapes the epoch's plan (JSON; not the ranks, which a resume may
        change)."""
        settings = {
            "sizes": self.sizes.tolist(),
            "weights": f"{zlib.crc32(self.weights.tobytes()):08x}",
            "num_samples": self.num_samples,
            "stop": self.stop,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }
        if self.schedule is not None:
            settings["weights"] = f"schedule {self.schedule.fingerprint()}"
        if self.lengths is not None:
            settings["lengths"] = f"{zlib.crc32(self.lengths.tobytes()):08x}"
        return settings

    def state_dict(
        self, *, batches_done: int | None = None, samples_done: int | None = None
    ) -> dict:
        """The epoch and the plan's positions done over all ranks (`load_state_dict` continues on
        any number of ranks): the global batches done after this rank's loop received
        `batches_done` batches (batch mode), or the samples done after `samples_done` samples
        (index mode); `make_loader`'s loader passes its counts itself. A paced epoch also
        saves the segments its rest is drawn in (O(sources) each: the one holding the
        position, and changes of weights the loader read ahead of it)."""
        begin = self._start or self._begin  # a pending resume, or where this pass began
        unit = 1
        if self.batch_size is None:
            done = begin + int(samples_done or 0) * self.num_replicas
            total = len(self.global_indices(self.epoch)) + self.known_from()
        else:
            batches = self._yielded
            if batches_done is not None:
                batches = int(batches_done)
            done = begin + batches * self.num_replicas
            first = self.known_from() // self.batch_size
            total = first + len(self._global_batches(self.epoch))
            unit = self.batch_size
        position = MixturePosition(self.epoch, min(done, total))
        draws = self._epoch(self.epoch)
        segments = None
        if self.paced or len(draws.segments) > 1 or draws.segments[0].weights is not None:
            segments = draws.needed(position.done * unit)
        return write_state(
            position,
            self.plan_settings(),
            batch_mode=self.batch_size is not None,
            segments=segments,
        )

    def load_state_dict(self, state: dict) -> None:
        """Continues the saved epoch (batch mode: on this sampler's number of ranks).

        Raises:
            ValueError: a state saved under other sources, weights or settings.
        """
        batch_mode = self.batch_size is not None
        position = read_state(state, self.plan_settings(), batch_mode=batch_mode)
        segments = read_segments(state, len(self.sizes))
        with self._lock:
            self.epoch = position.epoch
            self._start = position.done
            self._begin = 0
            self._yielded = 0
            self._handed = 0
            if segments is not None:
                self._draws.restore(position.epoch, segments)
            else:
                self._draws.epoch = -1  # drawn again from the epoch's start
            self._version += 1
            self._other = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None  # a lock does not pickle; a copy gets its own
        state["_view"] = None
        state["_other"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        mix = ", ".join(
            f"{n}: {w:.3f} of {s}"
            for n, w, s in zip(self.names, self.weights, self.sizes, strict=True)
        )
        return f"MixtureSampler({mix}; stop={self.stop!r}, num_samples={self.num_samples})"
