"""A mixture's draw plan: every index of an epoch, drawn across sources from `(seed, epoch)`.

Use when: an epoch of a `MixtureSampler` starts (the sampler caches its plan per epoch): at
every position a source is chosen with probability proportional to its weight among the sources
still drawing, and the source gives its next index from a fresh permutation of its own.
Cost: one vectorised draw per epoch (an int64 array of the epoch's length, the same on every
rank); a tiny source drawn a million times is one array operation, not a million generators.
Adapt here: `MixturePlan.sources` (how positions are given to sources under each stop rule)
and `MixturePlan.passes` (each source's order within a pass).
Trade-off: the plan is a function of `(seed, epoch)` and the settings only, so it is
regenerated on resume instead of saved; the whole epoch's plan is held in memory (8 bytes per
position).
Copy with: nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# The longest epoch "cycle_until_all_exhausted" may plan without `num_samples`: about
# max(size / weight) positions (an int64 array of it).
MAX_CYCLED = 2**31


class EpochPlan(NamedTuple):
    """An epoch's plan, as a sampler caches it."""

    epoch: int
    indices: np.ndarray
    """int64 indices into `ConcatDataset(datasets)`, all ranks' in order."""


class MixturePlan:
    """Draws the epoch's plan of a mixture of `len(sizes)` sources.

    Args:
        sizes: int64 samples per source (each positive).
        weights: float64 per source, normalised (`mixture_weights.parse_sources`).
        stop: one of `mixture_settings.STOPS`.
        num_samples: the epoch's length, or None (the stop rule ends it).
        seed: the base seed.
        shuffle: permute each source's indices (in order when False).
    """

    def __init__(
        self,
        sizes: np.ndarray,
        weights: np.ndarray,
        *,
        stop: str,
        num_samples: int | None,
        seed: int,
        shuffle: bool,
    ):
        self.sizes = sizes
        self.weights = weights
        self.stop = stop
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # each source's first index

    def check_length(self) -> None:
        """Refuses a "cycle_until_all_exhausted" epoch of over `MAX_CYCLED` positions."""
        if self.stop != "cycle_until_all_exhausted" or self.num_samples is not None:
            return
        drawn = self.weights > 0
        longest = float((self.sizes[drawn] / self.weights[drawn]).max())
        if longest > MAX_CYCLED:
            raise ValueError(
                f"stop='cycle_until_all_exhausted' would plan about {longest:.3g} samples per "
                "epoch (a source's size over its weight); give `num_samples` to cap the epoch."
            )

    def draw(self, epoch: int) -> EpochPlan:
        """Every index of `epoch`'s plan: the k-th draw from source s is position `k % n_s` of
        its pass `k // n_s`."""
        rng = np.random.default_rng([self.seed, epoch, 0x6D6978])
        sources = self.sources(rng)
        out = np.empty(len(sources), np.int64)
        for s in range(len(self.sizes)):
            where = np.flatnonzero(sources == s)
            if not len(where):
                continue
            passes = -(-len(where) // int(self.sizes[s]))
            out[where] = self.offsets[s] + self.passes(epoch, s, passes)[: len(where)]
        return EpochPlan(epoch, out)

    def passes(self, epoch: int, source: int, passes: int) -> np.ndarray:
        """`passes` permutations of the source's indices, one after the other (all at once)."""
        n = int(self.sizes[source])
        tiled = np.tile(np.arange(n, dtype=np.int64), (passes, 1))
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, source, 0x70])
            rng.permuted(tiled, axis=1, out=tiled)
        return tiled.ravel()

    def sources(self, rng: np.random.Generator) -> np.ndarray:
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
        limit = int(left[active].sum())
        if cap is not None:
            limit = min(cap, limit)
        chunks: list[np.ndarray] = []
        drawn = 0
        while drawn < limit and active.any():
            chunk = self._phase(rng, left, active)[: limit - drawn]
            chunks.append(chunk)
            drawn += len(chunk)
            left -= np.bincount(chunk, minlength=len(left))
            if self.stop == "first_exhausted" and (left[active] == 0).any():
                break
            active &= left > 0
        if not chunks:
            return np.empty(0, np.int64)
        return np.concatenate(chunks)

    def _phase(self, rng: np.random.Generator, left: np.ndarray, active: np.ndarray) -> np.ndarray:
        """One phase's sources: drawn over the active sources, up to the first one's last
        sample."""
        p = np.where(active, self.weights, 0.0)
        chunk = rng.choice(len(self.sizes), size=int(left[active].sum()), p=p / p.sum())
        end = len(chunk)
        for s in np.flatnonzero(active):
            hits = np.flatnonzero(chunk == s)
            if len(hits) >= left[s]:
                end = min(end, int(hits[left[s] - 1]) + 1)
        return chunk[:end]

    def _cycled(self, rng: np.random.Generator, cap: int | None) -> np.ndarray:
        """Sources drawn with the fixed weights (an exhausted one starts another pass in
        `draw`) up to the draw that completes the last source's first pass: that source's
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
        if cap is not None:
            end = min(end, cap)
        return draws[:end]
