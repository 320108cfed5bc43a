"""`make_loader`'s sampler rules: small named functions, each returning a `Decision`.

Use when: reading why `loader.recipe.reasons` says what it says of the sampler or the ranks, or
adding a rule (the worker processes' rules: `worker_rules.py`; the path's: `loader_path.py`).
Cost: none beyond reading the settings and the process group's size; a rule builds nothing but
the `ElasticDistributedSampler` it chooses.
Adapt here: the tables `SAMPLER_RULES` (under a process group of several ranks) and
`ORDER_RULES` (the order's reason once the path is known), run in order by `make_loader`: the
first rule that answers decides. A rule's reason is the sentence beside it;
`tests/common/loading/test_loader_rules.py` lists every rule with a case.
Trade-off: a rule sees a frozen record of facts, not the loader: a rule that needs another fact
adds a field to its record.
Copy with: common/loading/loader_path.py, common/resume/loader_contract.py,
  common/sampling/elastic_sampler.py, common/sampling/sharding.py, common/sizing/resources.py,
  common/sizing/sizing.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset

from recipes.common.loading.loader_path import Decision, Rule
from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler


@dataclass(frozen=True)
class RankFacts:
    """What the sampler rules read: the dataset, the settings so far, `make_loader`'s
    `distributed`, and the initialised process group's size (1 without one) and this rank."""

    dataset: Any
    settings: Mapping[str, Any]
    distributed: bool | None
    world: int
    rank: int

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    @property
    def split(self) -> bool:
        """Whether the ranks are to be split: several, and `distributed` is not False."""
        return self.distributed is not False and self.world > 1


def rank_facts(dataset, settings: Mapping[str, Any], distributed: bool | None) -> RankFacts:
    """The facts of the initialised process group, if any.

    Raises:
        ValueError: `distributed=True` without an initialised process group.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if distributed and not initialised:
        raise ValueError(
            "make_loader(distributed=True) needs an initialised torch.distributed process group "
            "(dist.init_process_group); leave `distributed` at None to split the ranks when there "
            "is one."
        )
    world = 1
    rank = 0
    if initialised:
        world = dist.get_world_size()
        rank = dist.get_rank()
    return RankFacts(dataset, dict(settings), distributed, world, rank)


def whole_dataset_by_choice(f: RankFacts) -> Decision | None:
    if f.distributed is not False or f.world < 2 or f.iterable:
        return None
    reason = f"every rank reads the whole dataset: distributed=False ({f.world} ranks)"
    return Decision("sampler", None, reason)


def iterable_says_its_ranks(f: RankFacts) -> Decision | None:
    split = getattr(f.dataset, "world_size", None)
    if not f.split or not f.iterable or split is None:
        return None
    reason = f"{type(f.dataset).__name__} splits itself over its {split} ranks"
    return Decision("ranks", None, reason)


def iterable_says_no_ranks(f: RankFacts) -> Decision | None:
    if not f.split or not f.iterable:
        return None
    reason = (
        f"{type(f.dataset).__name__} is iterable and says no world_size: it must split the "
        f"{f.world} ranks itself (every rank reads whatever it yields)"
    )
    return Decision("ranks", None, reason)


def given_batch_sampler(f: RankFacts) -> Decision | None:
    return _given(f, "batch_sampler")


def given_sampler(f: RankFacts) -> Decision | None:
    return _given(f, "sampler")


def _given(f: RankFacts, key: str) -> Decision | None:
    """The user's sampler wins; the reason says whether it splits the ranks and resumes on
    another number of them."""
    mine = f.settings.get(key)
    if not f.split or mine is None:
        return None
    inner = getattr(mine, "sampler", mine)
    ranks = getattr(mine, "num_replicas", getattr(inner, "num_replicas", None))
    reason = f"given ({type(mine).__name__}"
    if ranks is not None:
        reason += f", split over {ranks} ranks)"
    else:
        reason += f"; it says no num_replicas: make sure it splits the {f.world} ranks)"
    if isinstance(inner, DistributedSampler) and not isinstance(inner, ElasticDistributedSampler):
        reason += (
            "; a DistributedSampler's state refuses another number of ranks on resume, an "
            "ElasticDistributedSampler's does not"
        )
    return Decision(key, None, reason)


# Each rank's share of an epoch, by `drop_last`.
ELASTIC_TAIL = {
    True: "at most R - 1 samples dropped, and each rank's last partial batch",
    False: "padded with at most R - 1 repeats",
}


def elastic_sampler(f: RankFacts) -> Decision | None:
    # seed 0 on every rank, as DistributedSampler's: a `generator=` is often seeded per rank (for
    # the batches' own draws), and ranks whose orders differ would read some samples twice and
    # miss others
    if not f.split or f.iterable:
        return None
    shuffle = bool(f.settings.get("shuffle", False))
    drop_last = bool(f.settings.get("drop_last", False))
    sampler = ElasticDistributedSampler(
        f.dataset, num_replicas=f.world, rank=f.rank, shuffle=shuffle, seed=0, drop_last=drop_last
    )
    reason = (
        f"ElasticDistributedSampler: {f.world} ranks of an initialised process group, each its "
        f"share (shuffle={shuffle}, seed 0 on every rank as DistributedSampler's; another order: "
        f"sampler=ElasticDistributedSampler(dataset, seed=...); drop_last={drop_last}: "
        f"{ELASTIC_TAIL[drop_last]} per epoch for equal steps); the state resumes on any number "
        "of ranks; the next epoch starts by itself when the loop does not call "
        "loader.sampler.set_epoch"
    )
    return Decision("sampler", sampler, reason)


# First match. A sampler (or batch sampler) of the user's wins; then a map-style dataset gets an
# `ElasticDistributedSampler`. One rank, or `distributed=False` on an iterable: no rule answers.
SAMPLER_RULES: tuple[Rule, ...] = (
    whole_dataset_by_choice,
    iterable_says_its_ranks,
    iterable_says_no_ranks,
    given_batch_sampler,
    given_sampler,
    elastic_sampler,
)


@dataclass(frozen=True)
class OrderFacts:
    """What the order rules read: the path taken, whether batches are shuffled, whether the
    dataset is iterable, and what the sampler rules said (None: nothing)."""

    threads: bool
    shuffle: bool
    iterable: bool
    said: str | None


def own_random_sampler(f: OrderFacts) -> Decision | None:
    if f.threads or not f.shuffle or f.iterable:
        return None
    reason = (
        "RandomSampler with a generator of the loader's own (seeded from `generator`, else "
        "torch's RNG): state_dict() saves its state where each epoch's order is drawn"
    )
    return Decision("sampler", None, reason)


def sampler_rules_said(f: OrderFacts) -> Decision | None:
    if f.said is None:
        return None
    return Decision("sampler", None, f.said)


def dataloader_default_order(f: OrderFacts) -> Decision | None:
    if not f.threads or not f.shuffle:
        return None
    return Decision("sampler", None, "the DataLoader default")


def in_order(f: OrderFacts) -> Decision | None:
    if not f.threads:
        return None
    return Decision("sampler", None, "in order")


# First match. Worker processes without a shuffle keep what the sampler rules said, if anything.
ORDER_RULES: tuple[Rule, ...] = (
    own_random_sampler,
    sampler_rules_said,
    dataloader_default_order,
    in_order,
)
