"""Every rule of `make_loader`'s tables, with a case that triggers it: the setting it chooses and
its reason (issue 47). A rule added to a table without a case here fails
`test_every_rule_of_every_table_has_a_case`."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

from recipes.common.loading import loader_path, loader_rules, worker_rules
from recipes.common.loading.loader_path import (
    ISOLATE_MIN_BATCHES,
    PATH_RULES,
    THREAD_PATH_RULES,
    PathFacts,
    ThreadPathFacts,
    decide,
)
from recipes.common.loading.loader_rules import (
    ORDER_RULES,
    SAMPLER_RULES,
    OrderFacts,
    RankFacts,
)
from recipes.common.loading.worker_rules import (
    LOW_NOFILE,
    SAFETY_RULES,
    SHARING_STRATEGY,
    START_METHOD_RULES,
    WorkerFacts,
)
from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler
from recipes.common.workers.worker import ChainedWorkerInit

TABLES = {
    "PATH_RULES": PATH_RULES,
    "THREAD_PATH_RULES": THREAD_PATH_RULES,
    "SAMPLER_RULES": SAMPLER_RULES,
    "ORDER_RULES": ORDER_RULES,
    "START_METHOD_RULES": START_METHOD_RULES,
    "SAFETY_RULES": SAFETY_RULES,
}
# Every other rule decides in turn, the first that answers winning; these all apply.
APPLY_ALL = {"SAFETY_RULES"}


class Squares(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i * i


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


class SaysItsRanks(Stream):
    world_size = 4


class UsesCuda(Squares):
    uses_cuda_in_workers = True


def _path(path="auto", able=True, ready=True, asked=(), from_cache=True) -> PathFacts:
    return PathFacts(path, "Data", able, ready, asked, from_cache)


THREADS_WHY = "threads: Data reads its items from a memory-speed cache (the GIL released)"


def _thread_path(cpus=4, items=1000, record=None, extras=None) -> ThreadPathFacts:
    settings = {"batch_size": 8}
    return ThreadPathFacts(THREADS_WHY, list(range(items)), settings, cpus, record, extras or {})


def _ranks(dataset=None, settings=None, distributed=None, world=2) -> RankFacts:
    return RankFacts(dataset or Squares(), settings or {}, distributed, world, 0)


def _workers(dataset=None, settings=None, user_keys=(), nofile=65536) -> WorkerFacts:
    methods = ("fork", "spawn", "forkserver")
    return WorkerFacts(
        dataset or Squares(), settings or {}, frozenset(user_keys), nofile, methods, True
    )


@dataclass(frozen=True)
class Case:
    """`rule` of `table` triggered by `facts`: it chooses `setting` (or a setting of that type,
    for a class) for `key`, with a reason containing `says`; `patch`: (object, name, value)."""

    table: str
    rule: str
    facts: Any
    key: str
    setting: Any
    says: str
    patch: tuple = field(default=())


FORKSERVER = multiprocessing.get_context("forkserver")
NO_FORK = ((loader_path, "can_fork_here", lambda: False),)
CUDA_ON = ((torch.cuda, "is_initialized", lambda: True),)
CUDA_OFF = ((torch.cuda, "is_initialized", lambda: False),)
FD_SHARING = ((torch.multiprocessing, "get_sharing_strategy", lambda: "file_descriptor"),)
TUNED = {"settings": {"path": "threads"}, "when": "2026-12-01", "reason": "autotune: fed"}

CASES = [
    Case("PATH_RULES", "given_path", _path("workers"), "path", "workers", "given"),
    Case(
        "PATH_RULES",
        "no_thread_batches",
        _path(able=False, ready=False),
        "path",
        "workers",
        "worker processes: Data has no thread_batches() (loader_contract.ThreadBatched)",
    ),
    Case(
        "PATH_RULES",
        "thread_batches_false",
        _path(ready=False),
        "path",
        "workers",
        "worker processes: Data.thread_batches() is false",
    ),
    Case(
        "PATH_RULES",
        "worker_arguments_given",
        _path(asked=("num_workers",)),
        "path",
        "workers",
        "worker processes: num_workers given (path='threads' would refuse them)",
    ),
    Case(
        "PATH_RULES",
        "reads_a_cache",
        _path(),
        "path",
        "threads",
        "threads: Data reads its items from a memory-speed cache (the GIL released)",
    ),
    Case(
        "PATH_RULES",
        "decodes_in_threads",
        _path(from_cache=False),
        "path",
        "threads",
        "threads: Data decodes its items with TurboJPEG or OpenCV",
    ),
    Case(
        "THREAD_PATH_RULES",
        "autotuned_path",
        _thread_path(record=TUNED),
        "path",
        "threads",
        "threads of this process: autotuned 2026-12-01 on this machine",
    ),
    Case(
        "THREAD_PATH_RULES",
        "no_fork_here",
        _thread_path(),
        "path",
        "threads",
        THREADS_WHY + "; in this process: no child process can be forked here",
        NO_FORK,
    ),
    Case(
        "THREAD_PATH_RULES",
        "one_cpu",
        _thread_path(cpus=1),
        "path",
        "threads",
        "; in this process: 1 CPU for this rank, which the loop and a child would share",
    ),
    Case(
        "THREAD_PATH_RULES",
        "short_epoch",
        _thread_path(items=80),
        "path",
        "threads",
        f"; in this process: 10 batches an epoch, fewer than {ISOLATE_MIN_BATCHES}",
    ),
    Case(
        "THREAD_PATH_RULES",
        "isolated_child",
        _thread_path(),
        "path",
        "isolated",
        "isolated threads: Data reads its items from a memory-speed cache",
    ),
    Case(
        "SAMPLER_RULES",
        "whole_dataset_by_choice",
        _ranks(distributed=False),
        "sampler",
        None,
        "every rank reads the whole dataset: distributed=False (2 ranks)",
    ),
    Case(
        "SAMPLER_RULES",
        "iterable_says_its_ranks",
        _ranks(SaysItsRanks()),
        "ranks",
        None,
        "SaysItsRanks splits itself over its 4 ranks",
    ),
    Case(
        "SAMPLER_RULES",
        "iterable_says_no_ranks",
        _ranks(Stream()),
        "ranks",
        None,
        "Stream is iterable and says no world_size: it must split the 2 ranks itself",
    ),
    Case(
        "SAMPLER_RULES",
        "given_batch_sampler",
        _ranks(settings={"batch_sampler": [[0]]}),
        "batch_sampler",
        None,
        "given (list; it says no num_replicas: make sure it splits the 2 ranks)",
    ),
    Case(
        "SAMPLER_RULES",
        "given_sampler",
        _ranks(settings={"sampler": DistributedSampler(Squares(), num_replicas=2, rank=0)}),
        "sampler",
        None,
        "a DistributedSampler's state refuses another number of ranks",
    ),
    Case(
        "SAMPLER_RULES",
        "elastic_sampler",
        _ranks(settings={"drop_last": True}),
        "sampler",
        ElasticDistributedSampler,
        "drop_last=True: at most R - 1 samples dropped, and each rank's last partial batch",
    ),
    Case(
        "ORDER_RULES",
        "own_random_sampler",
        OrderFacts(False, True, False, None),
        "sampler",
        None,
        "RandomSampler with a generator of the loader's own",
    ),
    Case(
        "ORDER_RULES",
        "sampler_rules_said",
        OrderFacts(True, True, False, "said"),
        "sampler",
        None,
        "said",
    ),
    Case(
        "ORDER_RULES",
        "dataloader_default_order",
        OrderFacts(True, True, False, None),
        "sampler",
        None,
        "the DataLoader default",
    ),
    Case(
        "ORDER_RULES", "in_order", OrderFacts(True, False, False, None), "sampler", None, "in order"
    ),
    Case(
        "START_METHOD_RULES",
        "user_forkserver",
        _workers(
            settings={"multiprocessing_context": FORKSERVER}, user_keys={"multiprocessing_context"}
        ),
        "multiprocessing_context",
        FORKSERVER,
        "override; torch and the dataset's module preloaded in the fork server",
    ),
    Case(
        "START_METHOD_RULES",
        "user_context",
        _workers(
            settings={"multiprocessing_context": "spawn"}, user_keys={"multiprocessing_context"}
        ),
        "multiprocessing_context",
        "spawn",
        "override",
    ),
    Case(
        "START_METHOD_RULES",
        "forkserver_for_cuda",
        _workers(UsesCuda()),
        "multiprocessing_context",
        "forkserver",
        "forkserver: the dataset sets uses_cuda_in_workers",
    ),
    Case(
        "START_METHOD_RULES",
        "spawn_for_cuda",
        WorkerFacts(UsesCuda(), {}, frozenset(), 65536, ("fork", "spawn"), True),
        "multiprocessing_context",
        "spawn",
        "spawn: the dataset sets uses_cuda_in_workers and forkserver is unavailable",
    ),
    Case(
        "START_METHOD_RULES",
        "fork_after_cuda",
        _workers(),
        "multiprocessing_context",
        "fork",
        "(CUDA is initialised here; safe since workers do not use it)",
        CUDA_ON,
    ),
    Case(
        "START_METHOD_RULES",
        "fork",
        _workers(),
        "multiprocessing_context",
        "fork",
        "fork: workers start in milliseconds with the parent's imports; a dataset",
        CUDA_OFF,
    ),
    Case(
        "SAFETY_RULES",
        "worker_init_first",
        _workers(),
        "worker_init_fn",
        ChainedWorkerInit,
        "worker_init (OpenCV fork fix, 1 torch thread, seeded RNGs), then yours",
    ),
    Case(
        "SAFETY_RULES",
        "start_method",
        _workers(),
        "multiprocessing_context",
        "fork",
        "fork: workers start in milliseconds",
        CUDA_OFF,
    ),
    Case(
        "SAFETY_RULES",
        "file_system_sharing",
        _workers(nofile=256),
        SHARING_STRATEGY,
        "file_system",
        f"file_system: ulimit -n is 256 (< {LOW_NOFILE})",
        FD_SHARING,
    ),
]


def test_every_rule_of_every_table_has_a_case():
    for name, table in TABLES.items():
        assert [c.rule for c in CASES if c.table == name] == [r.__name__ for r in table], name
    modules = (loader_path, loader_rules, worker_rules)
    tables = {n for m in modules for n in vars(m) if n.endswith("_RULES")}
    assert tables == set(TABLES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.table}.{c.rule}")
def test_each_rule_chooses_its_setting_with_its_reason(case, monkeypatch):
    for owner, name, value in case.patch:
        monkeypatch.setattr(owner, name, value)
    table = TABLES[case.table]
    rule = next(r for r in table if r.__name__ == case.rule)
    if case.table in APPLY_ALL:
        decision = rule(case.facts)
    else:
        decision = decide(table, case.facts)
        assert decision.rule == case.rule  # the rule answered, none before it
    assert decision is not None and decision.key == case.key
    assert decision.reason == rule(case.facts).reason
    assert case.says in decision.reason
    if isinstance(case.setting, type):
        assert isinstance(decision.setting, case.setting)
    else:
        assert decision.setting == case.setting


def test_no_rule_answers_for_one_rank_or_off_linux():
    assert decide(SAMPLER_RULES, _ranks(world=1)) is None
    assert decide(SAMPLER_RULES, _ranks(Stream(), distributed=False)) is None
    off_linux = WorkerFacts(Squares(), {}, frozenset(), 65536, ("spawn",), False)
    assert decide(START_METHOD_RULES, off_linux) is None
    assert decide(ORDER_RULES, OrderFacts(False, False, False, None)) is None
