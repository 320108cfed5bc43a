"""`make_loader`'s sampler and safety rules: small named functions, each returning a `Decision`.

Use when: reading why `loader.recipe.reasons` says what it says of the sampler, the ranks, the
workers' start method, `worker_init_fn` or the sharing strategy; or adding a rule.
Cost: none beyond reading the settings and the process group's size; a rule builds nothing but
the `ElasticDistributedSampler` it chooses.
Adapt here: the tables `SAMPLER_RULES`, `ORDER_RULES`, `START_METHOD_RULES` (the first rule that
answers decides) and `SAFETY_RULES` (every rule that answers applies). A rule's reason is the
sentence beside it; `tests/common/loading/test_loader_rules.py` lists every rule with a case.
Trade-off: a rule sees a frozen record of facts, not the loader: a rule that needs another fact
adds a field to its record.
Copy with: common/loader_warning.py, common/sampling/elastic_sampler.py,
  common/sampling/sharding.py, common/workers/process_lifetime.py, common/workers/worker.py.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset

from recipes.common.loader_warning import LoaderWarning
from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler
from recipes.common.workers.worker import ChainedWorkerInit

# Below this soft `ulimit -n`, DataLoader's default `file_descriptor` sharing strategy runs
# out of descriptors once a few hundred shared tensors are alive.
LOW_NOFILE = 4096
# Python containers larger than this on a dataset cost forked workers real memory (copy-on-read).
COPY_ON_READ_ITEMS = 100_000
# The DataLoader arguments it rejects with 0 workers.
WORKER_ARGUMENTS = ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout")
ZERO_WORKERS_DROPPED = "dropped: DataLoader rejects it with 0 workers"
# The one decision that is not a DataLoader argument: torch's process-wide sharing strategy.
SHARING_STRATEGY = "sharing_strategy"


@dataclass(frozen=True)
class Decision:
    """What one rule chose: `setting` for `key`, and `reason`, the sentence that
    `loader.recipe.reasons[key]` shows. `rule`: the deciding rule's name (`decide` fills it)."""

    key: str
    setting: Any
    reason: str
    rule: str = ""


Rule = Callable[[Any], "Decision | None"]


def decide(rules: Sequence[Rule], facts: Any) -> Decision | None:
    """The decision of the first rule in `rules` that answers for `facts`, named; None when no
    rule does."""
    for rule in rules:
        decision = rule(facts)
        if decision is not None:
            return replace(decision, rule=rule.__name__)
    return None


# -- the sampler under a process group of several ranks ------------------------------------------


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


# -- the order's reason, once the path is known ----------------------------------------------------


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


# -- worker processes: start method, worker_init_fn, sharing strategy -----------------------------


@dataclass(frozen=True)
class WorkerFacts:
    """What the safety rules read: the dataset, the settings so far, the user's own keys, the
    soft `ulimit -n`, and the platform's start methods."""

    dataset: Any
    settings: Mapping[str, Any]
    user_keys: frozenset[str]
    nofile_limit: int
    methods: tuple[str, ...]
    linux: bool


def worker_facts(dataset, settings, user_keys, nofile_limit: int) -> WorkerFacts:
    methods = tuple(multiprocessing.get_all_start_methods())
    linux = sys.platform.startswith("linux")
    return WorkerFacts(dataset, dict(settings), frozenset(user_keys), nofile_limit, methods, linux)


def start_method_name(context) -> str:
    """A `multiprocessing_context` setting's start method: the string itself, or the context's."""
    if isinstance(context, str):
        return context
    return context.get_start_method()


# NOTE [fork and CUDA]
# Worker processes (and the isolated loader's child) start with `fork`, also after CUDA is
# initialised in the parent: a forked child cannot use CUDA, but forking is safe while the child
# itself never touches it, which PyTorch's own default relies on. `forkserver` or `spawn` would
# re-import torch in every worker (a 15-54 s first batch on a 16-core GPU node) and crash scripts
# without an `if __name__ == "__main__":` guard. A dataset whose workers do use CUDA says so with
# `uses_cuda_in_workers = True` and gets `forkserver` (torch and the dataset's module preloaded
# into the fork server, so each worker starts warm), or `spawn` where there is no fork server.
# `fork` is set explicitly, so Python 3.14's forkserver default does not bring the slow start back.


def user_forkserver(f: WorkerFacts) -> Decision | None:
    if "multiprocessing_context" not in f.user_keys:
        return None
    context = f.settings["multiprocessing_context"]
    if start_method_name(context) != "forkserver":
        return None
    reason = "override; torch and the dataset's module preloaded in the fork server"
    return Decision("multiprocessing_context", context, reason)


def user_context(f: WorkerFacts) -> Decision | None:
    if "multiprocessing_context" not in f.user_keys:
        return None
    return Decision("multiprocessing_context", f.settings["multiprocessing_context"], "override")


def forkserver_for_cuda(f: WorkerFacts) -> Decision | None:
    # See NOTE [fork and CUDA]
    if not getattr(f.dataset, "uses_cuda_in_workers", False) or "forkserver" not in f.methods:
        return None
    reason = (
        "forkserver: the dataset sets uses_cuda_in_workers, and CUDA cannot be used in a "
        "forked child; torch and the dataset's module are preloaded so each worker starts "
        "from a warm fork server instead of importing torch"
    )
    return Decision("multiprocessing_context", "forkserver", reason)


def spawn_for_cuda(f: WorkerFacts) -> Decision | None:
    if not getattr(f.dataset, "uses_cuda_in_workers", False):
        return None
    reason = "spawn: the dataset sets uses_cuda_in_workers and forkserver is unavailable"
    return Decision("multiprocessing_context", "spawn", reason)


def fork_after_cuda(f: WorkerFacts) -> Decision | None:
    # See NOTE [fork and CUDA]
    if "fork" not in f.methods or not f.linux or not torch.cuda.is_initialized():
        return None
    reason = (
        "fork: workers start in milliseconds with the parent's imports (CUDA is initialised "
        "here; safe since workers do not use it); a dataset that uses CUDA in workers sets "
        "uses_cuda_in_workers = True"
    )
    return Decision("multiprocessing_context", "fork", reason)


def fork(f: WorkerFacts) -> Decision | None:
    # See NOTE [fork and CUDA]
    if "fork" not in f.methods or not f.linux:
        return None
    reason = (
        "fork: workers start in milliseconds with the parent's imports; a dataset that uses "
        "CUDA in workers sets uses_cuda_in_workers = True"
    )
    return Decision("multiprocessing_context", "fork", reason)


# First match: the user's context wins; no rule answers off Linux without CUDA in workers.
START_METHOD_RULES: tuple[Rule, ...] = (
    user_forkserver,
    user_context,
    forkserver_for_cuda,
    spawn_for_cuda,
    fork_after_cuda,
    fork,
)


def worker_init_first(f: WorkerFacts) -> Decision | None:
    # The OpenCV fork deadlock and identical NumPy draws across workers: `worker_init`, chained
    # before the user's own `worker_init_fn`.
    reason = "worker_init (OpenCV fork fix, 1 torch thread, seeded RNGs), then yours"
    return Decision("worker_init_fn", ChainedWorkerInit(f.settings.get("worker_init_fn")), reason)


def start_method(f: WorkerFacts) -> Decision | None:
    return decide(START_METHOD_RULES, f)


def file_system_sharing(f: WorkerFacts) -> Decision | None:
    # "received 0 items of ancdata" (pytorch#973); the switch is process-wide: torch has no
    # per-loader one.
    if f.nofile_limit >= LOW_NOFILE:
        return None
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        return None
    reason = (
        f"file_system: ulimit -n is {f.nofile_limit} (< {LOW_NOFILE}); file_descriptor "
        "sharing would run out of descriptors"
    )
    return Decision(SHARING_STRATEGY, "file_system", reason)


# Every rule that answers applies, in this order (worker processes only).
SAFETY_RULES: tuple[Rule, ...] = (worker_init_first, start_method, file_system_sharing)


def warn_copy_on_read(dataset, workers: int) -> None:
    """Large Python containers on a dataset grow every forked worker's memory as it reads them
    (reference counts write to every object's page: pytorch#13246)."""
    for owner, prefix in ((dataset, ""), (getattr(dataset, "dataset", None), "dataset.")):
        if not hasattr(owner, "__dict__"):
            continue
        for name, value in vars(owner).items():
            if isinstance(value, (list, dict, tuple)) and len(value) > COPY_ON_READ_ITEMS:
                warnings.warn(
                    f"{type(dataset).__name__}.{prefix}{name} is a Python {type(value).__name__} "
                    f"of {len(value):,} items: each of the {workers} forked workers copies the "
                    "pages it reads (reference counts write to them), so worker memory grows "
                    "through the epoch until it equals the parent's. Hold it in numpy arrays, or "
                    "PackedStrings (recipes.common.caches.packed_strings) for strings.",
                    LoaderWarning,
                    stacklevel=4,
                )


def preload_forkserver(dataset) -> None:
    """Imports done once in the fork server, inherited by every worker it forks."""
    modules = ["torch", "numpy"]
    module = type(dataset).__module__
    if module and module not in ("__main__", "builtins"):
        modules.append(module)
    multiprocessing.set_forkserver_preload(modules)
