"""ElasticDistributedSampler: `DistributedSampler`'s split of a map-style dataset over the ranks,
resumable on any number of ranks.

Use when: a map-style dataset is read under DDP (`make_loader` gives it one by itself under an
initialised process group) and a job may come back in another shape (a node lost, more GPUs):
the rest of the epoch is dealt over the new ranks, every sample once.
Cost: one permutation of N indices per epoch (`torch.randperm` seeded by `seed + epoch`, as
`DistributedSampler`), kept for the epoch; a state is a few numbers.
Adapt here: nothing; `shuffle`, `seed` and `drop_last` are `DistributedSampler`'s.
Trade-off: the order is dealt by position, rank r taking positions r, r + R, ...: the same
indices as `DistributedSampler` for the same seed, epoch and ranks. Ranks that step together
have then consumed a prefix of the epoch's order, so rank 0's count says where every rank is,
and a resume deals the rest of the order over the new ranks the same way. Each deal pads
(repeating the order's first indices) or, with `drop_last`, drops at most R - 1 samples so
that every rank takes the same number: a resume on another number of ranks adds a deal, and
with it at most R - 1 more repeats (or drops) in that epoch.
Copy with: common/sampling/sharding.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from recipes.common.sampling.sharding import distributed_world


class _EpochOrder(NamedTuple):
    """The plan of one epoch, kept for the epoch's later calls."""

    epoch: int
    order: np.ndarray


class ElasticDistributedSampler(DistributedSampler):
    """Indices of this rank's share of each epoch; a drop-in for `DistributedSampler` (a
    subclass, so Lightning, accelerate and the transformers Trainer keep it as theirs).

    Args:
        dataset: the map-style dataset (only its length is read).
        num_replicas, rank: the ranks; `torch.distributed`'s when initialised, else 1 and 0.
        shuffle: a new permutation each epoch from `seed + epoch`; in order when False.
        seed: the same on every rank.
        drop_last: drop the tail of the order that does not divide over the ranks, instead
            of padding it with the order's first indices.

    Under `make_loader`'s loader (`StatefulLoader`, `ThreadLoader`), `loader.state_dict()` saves
    the position and `load_state_dict()` continues the epoch on any number of ranks; an epoch
    whose loop ended moves to the next one when the loop does not call `set_epoch`
    (`advance_epochs`). In a plain DataLoader call `set_epoch` before each epoch, as with
    `DistributedSampler`.

    Example:
        >>> sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=0)
        >>> loader = make_loader(dataset, batch_size=32, sampler=sampler)
        >>> for epoch in range(3):
        ...     sampler.set_epoch(epoch)
        ...     for batch in loader: ...
    """

    advance_epochs = True  # `loader_contract.EpochAdvancing`: the loader moves on a finished epoch

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        world, here = distributed_world()
        if num_replicas is None:
            num_replicas = world
        if rank is None:
            rank = here
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        if self.num_replicas < 1:
            raise ValueError(f"`num_replicas` must be positive, but is {num_replicas!r} instead.")
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"`rank` must be in [0, {self.num_replicas}), but is {self.rank!r} instead."
            )
        super().__init__(
            dataset,
            num_replicas=self.num_replicas,
            rank=self.rank,
            shuffle=bool(shuffle),
            seed=int(seed),
            drop_last=bool(drop_last),
        )
        self.num_samples_total = len(dataset)
        self._start = 0  # samples of the epoch's order done before this pass (a loaded state)
        self._begin = 0  # where the current pass began in the order
        self._cache: _EpochOrder | None = None

    # ---- the order ---------------------------------------------------------------------
    def order(self, epoch: int | None = None) -> np.ndarray:
        """Every index of `epoch` (default: the current one) in order, on every rank alike."""
        if epoch is None:
            epoch = self.epoch
        epoch = int(epoch)
        if self._cache is None or self._cache.epoch != epoch:
            n = self.num_samples_total
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's draw
                order = torch.randperm(n, generator=g).numpy()
            else:
                order = np.arange(n, dtype=np.int64)
            self._cache = _EpochOrder(epoch, order)
        return self._cache.order

    def deal(self, start: int = 0) -> np.ndarray:
        """This rank's indices of the order's rest from position `start`, padded (or cut) to
        an equal count on every rank."""
        order = self.order()
        r = self.num_replicas
        rest = order[min(start, len(order)) :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % r]
        elif len(rest) % r and len(order):
            rest = np.concatenate([rest, order[np.arange(r - len(rest) % r) % len(order)]])
        return rest[self.rank :: r]

    # ---- Sampler protocol --------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        self._begin, self._start = self._start, 0  # a resumed epoch continues only once
        yield from self.deal(self._begin).tolist()

    def __len__(self) -> int:
        return len(self.deal(self._start))

    def set_epoch(self, epoch: int) -> None:
        """Draws `epoch`'s order (the same on every rank): call before each epoch, as with
        `DistributedSampler` (under `make_loader`'s loader a loop that does not gets the next
        epoch each time it iterates the loader again). The epoch it is at already keeps a loaded
        position (Lightning sets the epoch after `iter()`, where a resumed epoch has begun)."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._start = self._begin = 0

    # ---- resume ------------------------------------------------------------------------
    def plan_settings(self) -> dict:
        """What shapes the epoch's order (JSON; not the ranks, which a resume may change)."""
        return {
            "num_samples": self.num_samples_total,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def state_dict(self, *, samples_done: int | None = None) -> dict:
        """The epoch and the samples of its order done over all ranks, after this rank's loop
        received `samples_done` samples of the current pass (every rank as many: DDP ranks
        step together). `make_loader`'s loader passes its own count (batches x batch size);
        without it the position is where this pass began.
        """
        if samples_done is None:
            warnings.warn(
                "ElasticDistributedSampler.state_dict() without samples_done= gives where this "
                "pass began; save loader.state_dict() (make_loader's loader counts what the loop "
                "received).",
                stacklevel=2,
            )
        begin = self._start or self._begin
        done = begin + int(samples_done or 0) * self.num_replicas
        return {
            "epoch": self.epoch,
            "samples_done": min(done, self.num_samples_total),
            "plan": self.plan_settings(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues the saved epoch on this sampler's (possibly different) number of ranks.

        Raises:
            ValueError: a state saved for another dataset size or other settings.
        """
        saved = state.get("plan") or {}
        mine = self.plan_settings()
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if differ:
            raise ValueError(
                "This ElasticDistributedSampler state was saved under other settings: "
                + ", ".join(f"{k}={saved.get(k)!r} (saved) vs {mine.get(k)!r}" for k in differ)
                + "; resume with the same dataset "
                "and settings (they decide the epoch's order)."
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["samples_done"])
        self._begin = 0

    def __repr__(self) -> str:
        return (
            f"ElasticDistributedSampler(rank {self.rank} of {self.num_replicas}, "
            f"{self.num_samples_total} samples, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last})"
        )
