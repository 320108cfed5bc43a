"""MixtureSampler: weighted sampling across datasets, exact under DDP and on resume.

Use when: training draws from several sources at set proportions (web text, code and books for a
language model; several speech corpora; several image sets) through one
`torch.utils.data.ConcatDataset(datasets)`. Each epoch's plan is drawn from `(seed, epoch)`:
at every position a source is chosen with probability proportional to its weight among the
sources still drawing, and the source gives its next index from a fresh permutation of its
own (no index repeats within a source before the source is exhausted).
Cost: per epoch, one vectorised draw of the plan (an int64 array of the epoch's length, the
same on every rank), cached for the epoch; per index, nothing.
Adapt here: `STOPS`.
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
`MixtureIterable` (`mixture_iterable.py`) interleaves iterable datasets (`ShardedIterableDataset`
shard sets, each exact over ranks and workers) by the same weights and stop rules, for remote
corpora.
Copy with: common/sampling/sharding.py."""

from __future__ import annotations

import operator
import zlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from torch.utils.data import ConcatDataset

from recipes.common.sampling.sharding import distributed_world

STOPS = ("drop_exhausted", "first_exhausted", "cycle_until_all_exhausted", "never")
# The longest epoch "cycle_until_all_exhausted" may plan without `num_samples`: about
# max(size / weight) positions (an int64 array of it).
MAX_CYCLED = 2**31


def parse_sources(values, weights, what: str) -> tuple[list[str], list, np.ndarray]:
    """`(names, values, normalised weights)` from two sequences, or two mappings by source name.

    Raises:
        ValueError: mismatched shapes or names; negative, non-finite or all-zero weights.
    """
    if isinstance(values, Mapping):
        if not isinstance(weights, Mapping) or set(weights) != set(values):
            raise ValueError(
                f"`weights` must name the same sources as `{what}` ({sorted(values)}), but names "
                f"{sorted(weights) if isinstance(weights, Mapping) else type(weights).__name__}."
            )
        names = [str(k) for k in values]
        weights = [weights[k] for k in values]
        values = list(values.values())
    elif isinstance(weights, Mapping):
        raise ValueError(
            f"`weights` is a mapping but `{what}` is not: give both as mappings from source name, "
            "or both as sequences."
        )
    else:
        names = [str(i) for i in range(len(values))]
        values = list(values)
    array = np.asarray(weights, dtype=np.float64)
    if not values or array.shape != (len(values),):
        raise ValueError(
            f"`{what}` and `weights` need one value per source, but have {len(values)} and "
            f"{array.size}."
        )
    if not np.isfinite(array).all() or (array < 0).any() or array.sum() <= 0:
        raise ValueError(
            "`weights` must be non-negative and finite with a positive sum, but are "
            f"{array.tolist()}."
        )
    if not np.isfinite(array.sum()):
        raise ValueError(
            f"`weights` sum to infinity in float64 (they are {array.tolist()}): only their ratios "
            "matter, so scale them down (divide by the largest)."
        )
    return names, values, array / array.sum()


def check_stop(stop: str, num_samples) -> None:
    if stop == "all_exhausted":
        raise ValueError(
            "stop='all_exhausted' is ambiguous: Hugging Face `datasets` cycles exhausted sources "
            "until all are seen whole (here 'cycle_until_all_exhausted': the proportions hold), "
            "and recipes 0.1 dropped them (here 'drop_exhausted', the default: every sample "
            "exactly once). Name the rule you want."
        )
    if stop not in STOPS:
        raise ValueError(f"`stop` must be one of {STOPS}, but is {stop!r} instead.")
    if stop == "never" and num_samples is None:
        raise ValueError(
            "stop='never' refills sources for ever: give `num_samples`, the epoch's length."
        )


def check_count(name: str, value, *, minimum: int = 1) -> int | None:
    """`value` as a plain int (numpy ints too: states are JSON), checked; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer of at least {minimum}, but is {value!r} instead."
        )
    return int(value)


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
        self.names, sizes, self.weights = parse_sources(sizes, weights, "sizes")
        raw = np.asarray(sizes)
        if raw.dtype.kind not in "iu" and not (
            raw.dtype.kind == "f" and np.all(raw == np.floor(raw))
        ):
            raise ValueError(f"`sizes` must be whole numbers of samples, but are {raw.tolist()}.")
        self.sizes = raw.astype(np.int64)
        if (self.sizes <= 0).any():
            raise ValueError(
                f"every source needs samples; sizes are {self.sizes.tolist()} (source "
                f"{self.names[int(np.argmin(self.sizes))]!r})."
            )
        check_stop(stop, num_samples)
        num_samples = check_count("num_samples", num_samples)
        batch_size = check_count("batch_size", batch_size)
        seed = check_count("seed", seed, minimum=0)
        if stop == "cycle_until_all_exhausted" and num_samples is None:
            drawn = self.weights > 0
            longest = float((self.sizes[drawn] / self.weights[drawn]).max())
            if longest > MAX_CYCLED:
                raise ValueError(
                    f"stop='cycle_until_all_exhausted' would plan about {longest:.3g} samples per "
                    "epoch (a source's size over its weight); give `num_samples` to cap the epoch."
                )
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.num_samples = num_samples
        self.stop = stop
        self.seed = int(seed)
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.drop_last = drop_last
        world, here = distributed_world()
        self.num_replicas = world if num_replicas is None else int(num_replicas)
        self.rank = here if rank is None else int(rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"`rank` must be in [0, {self.num_replicas}), but is {self.rank!r} instead."
            )
        self.epoch = 0
        self._start = self._begin = self._yielded = (
            0  # batch mode: global batches done, as LengthBucketSampler
        )
        self._cache: tuple[int, np.ndarray] | None = None

    # ---- the epoch's plan --------------------------------------------------------------
    def global_indices(self, epoch: int | None = None) -> np.ndarray:
        """Every index of `epoch`'s plan (all ranks), in order: the same on every rank."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._draw(epoch))
        return self._cache[1]

    def _draw(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, 0x6D6978])
        sources = self._sources(rng)
        out = np.empty(len(sources), np.int64)
        for s in range(len(self.sizes)):  # the k-th draw from s: pass k // n_s, position k % n_s
            where = np.flatnonzero(sources == s)
            if not len(where):
                continue
            out[where] = (
                self.offsets[s]
                + self._passes(epoch, s, -(-len(where) // int(self.sizes[s])))[: len(where)]
            )
        return out

    def _passes(self, epoch: int, source: int, passes: int) -> np.ndarray:
        """`passes` permutations of the source's indices, one after the other (all at once: a
        tiny source drawn a million times is one array operation, not a million generators)."""
        n = int(self.sizes[source])
        tiled = np.tile(np.arange(n, dtype=np.int64), (passes, 1))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch, source, 0x70]).permuted(
                tiled, axis=1, out=tiled
            )
        return tiled.ravel()

    def _sources(self, rng: np.random.Generator) -> np.ndarray:
        """The source of every position of the epoch. With the exhausting rules, in phases: a
        phase draws with fixed probabilities over the sources still drawing and ends where one
        of them gives its last sample (one always does: a phase draws as many positions as
        the active sources have samples left); the next phase renormalises without it."""
        cap = self.num_samples
        if self.stop == "never":
            return rng.choice(len(self.sizes), size=cap, p=self.weights)
        if self.stop == "cycle_until_all_exhausted":
            return self._cycled(rng, cap)
        left = self.sizes.copy()
        active = self.weights > 0  # a source of weight 0 never draws
        total = int(left[active].sum())
        limit = total if cap is None else min(cap, total)
        chunks: list[np.ndarray] = []
        drawn = 0
        while drawn < limit and active.any():
            p = np.where(active, self.weights, 0.0)
            chunk = rng.choice(len(self.sizes), size=int(left[active].sum()), p=p / p.sum())
            end = len(chunk)
            for s in np.flatnonzero(active):
                hits = np.flatnonzero(chunk == s)
                if len(hits) >= left[s]:
                    end = min(end, int(hits[left[s] - 1]) + 1)
            chunk = chunk[:end][: limit - drawn]
            chunks.append(chunk)
            drawn += len(chunk)
            left -= np.bincount(chunk, minlength=len(left))
            if self.stop == "first_exhausted" and (left[active] == 0).any():
                break
            active &= left > 0
        return np.concatenate(chunks) if chunks else np.empty(0, np.int64)

    def _cycled(self, rng: np.random.Generator, cap: int | None) -> np.ndarray:
        """Sources drawn with the fixed weights (an exhausted one starts another pass in
        `_draw`) up to the draw that completes the last source's first pass: that source's
        `size`-th draw. Drawn in blocks of the sources' total size until every source drawing
        has been drawn that often."""
        drawing = self.weights > 0
        counts = np.zeros(len(self.sizes), np.int64)
        blocks: list[np.ndarray] = []
        total = 0
        while not (counts[drawing] >= self.sizes[drawing]).all() and (cap is None or total < cap):
            block = rng.choice(len(self.sizes), size=int(self.sizes.sum()), p=self.weights)
            blocks.append(block)
            counts += np.bincount(block, minlength=len(self.sizes))
            total += len(block)
        draws = np.concatenate(blocks)
        end = len(draws)
        if (counts[drawing] >= self.sizes[drawing]).all():
            end = 1 + max(
                int(np.flatnonzero(draws == s)[self.sizes[s] - 1]) for s in np.flatnonzero(drawing)
            )
        return draws[: end if cap is None else min(end, cap)]

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
        if self.batch_size is None:
            self._begin, self._start = self._start, 0  # a resumed epoch continues only once
            yield from self._padded(self.epoch, self._begin)[
                self.rank :: self.num_replicas
            ].tolist()
            return
        plan = self._batch_plan(self.epoch, self._start)
        self._begin = self._start
        self._start = 0
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
            self._start = self._begin = self._yielded = 0

    # ---- what it drew ----------------------------------------------------------------------
    def source_of(self, indices) -> np.ndarray:
        """The source number of each `ConcatDataset` index."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def source_counts(self, samples_done: int | None = None, *, start: int = 0) -> dict[str, int]:
        """Samples per source among this rank's `samples_done` samples of the current pass from
        its `start`-th (all of them when None): the realised mixture, by name."""
        mine = (
            self._padded(self.epoch, self._begin)[self.rank :: self.num_replicas]
            if self.batch_size is None
            else np.concatenate(self._batch_plan(self.epoch, 0) or [np.empty(0, np.int64)])
        )
        mine = mine[start:] if samples_done is None else mine[start : start + samples_done]
        counts = np.bincount(self.source_of(mine), minlength=len(self.sizes))
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
        begin = self._start if self._start else self._begin
        if self.batch_size is None:
            done = begin + int(samples_done or 0) * self.num_replicas
            return {
                "epoch": self.epoch,
                "samples_done": min(done, len(self.global_indices(self.epoch))),
                "plan": self.plan_settings(),
            }
        done = self._yielded if batches_done is None else int(batches_done)
        total = len(self._global_batches(self.epoch))
        return {
            "epoch": self.epoch,
            "global_batches_done": min(total, begin + done * self.num_replicas),
            "plan": self.plan_settings(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues the saved epoch (batch mode: on this sampler's number of ranks).

        Raises:
            ValueError: a state saved under other sources, weights or settings.
        """
        saved = dict(state.get("plan") or {})
        mine = self.plan_settings()
        saved.pop(
            "num_replicas", None
        )  # states of recipes before the index mode resumed elastically
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if differ:
            raise ValueError(
                "This MixtureSampler state was saved under other settings: "
                + ", ".join(f"{k}={saved.get(k)!r} (saved) vs {mine.get(k)!r}" for k in differ)
                + "; resume with the same sources, "
                "weights and settings (they decide the epoch's plan)."
            )
        self.epoch = int(state["epoch"])
        self._start = int(
            state.get("global_batches_done" if self.batch_size else "samples_done", 0)
        )
        self._begin = self._yielded = 0

    def __repr__(self) -> str:
        mix = ", ".join(
            f"{n}: {w:.3f} of {s}"
            for n, w, s in zip(self.names, self.weights, self.sizes, strict=True)
        )
        return f"MixtureSampler({mix}; stop={self.stop!r}, num_samples={self.num_samples})"


class MixtureSources(ConcatDataset):
    """`ConcatDataset(datasets)` that reads a batch part by part: each part's `__getitems__`
    (a token cache's one-call batch read) for its indices, the items back in the batch's order.
    A plain `ConcatDataset` reads item by item (`__getitem__` through `bisect`): on a token
    cache about half the rate. Use it for a `MixtureSampler`'s sources."""

    def __init__(self, datasets):
        super().__init__(datasets)
        self._starts = np.asarray(
            [0, *self.cumulative_sizes[:-1]], dtype=np.int64
        )  # each source's first index

    def __getitems__(self, indices: list[int]) -> list:
        cumulative = self.cumulative_sizes
        if len(cumulative) == 1:
            source = self.datasets[0]
            return (
                source.__getitems__(indices)
                if hasattr(source, "__getitems__")
                else [source[i] for i in indices]
            )
        n = len(self)
        try:
            wanted = np.fromiter(indices, np.int64, len(indices))
        except OverflowError:  # an index beyond int64 is beyond any dataset
            bad = next(int(i) for i in indices if not -(2**63) <= int(i) < 2**63)
            raise IndexError(
                f"index {bad} is out of range for the {n} samples of these sources."
            ) from None
        if not len(wanted):
            return []
        low = int(wanted.min())
        high = int(wanted.max())
        if low < -n or high >= n:
            bad = next(int(i) for i in wanted if not -n <= i < n)
            raise IndexError(f"index {bad} is out of range for the {n} samples of these sources.")
        if low < 0:
            wanted = np.where(wanted < 0, wanted + n, wanted)
        bounds = self._starts
        parts = bounds.searchsorted(wanted, side="right") - 1  # each index's source
        order = parts.argsort(kind="stable")  # the batch's indices source by source
        local = (wanted - bounds[parts])[order].tolist()
        got: list = []
        at = 0
        for part, count in enumerate(np.bincount(parts, minlength=len(self.datasets)).tolist()):
            if count:
                source = self.datasets[part]
                ids = local[at : at + count]
                got += (
                    source.__getitems__(ids)
                    if hasattr(source, "__getitems__")
                    else [source[i] for i in ids]
                )
                at += count
        if len(got) != len(order):
            raise RuntimeError(f"the sources returned {len(got)} items for {len(order)} indices.")
        if len(got) == 1:
            return got
        back = np.empty_like(order)
        back[order] = np.arange(len(order))  # each batch position's place in `got`
        return list(operator.itemgetter(*back.tolist())(got))  # the batch's order, in one C call
