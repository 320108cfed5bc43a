"""Exactly once, proven (issue #19): a Hypothesis state machine drives a loader through random
sequences of taking batches, leaving an epoch with `break`, starting epochs, saving its state and
rebuilding it from the state (in another configuration), killing a worker under `RobustLoader`, and
changing the number of ranks where the sampler supports it. Invariant: in every epoch, the batches
the loop received equal, in order, what an uninterrupted run of the same seed delivers (with a
change of
ranks: every planned sample exactly once, counted, with only the documented padding repeated).

The default suite runs a bounded number of examples; `HYPOTHESIS_PROFILE=thorough` runs many more.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    RandomSampler,
    get_worker_info,
)

from recipes.common import LengthBucketSampler, RobustLoader, ShardedIterableDataset, make_loader
from recipes.common.sampling.mixture import MixtureSampler
from recipes.common.sampling.pacing.mixture_schedule import Schedule
from recipes.testing import make_int_shards

N = 48
SHARDS = [9, 14, 6, 11, 8, 12]
SEED = 1234
MAP_KINDS = [
    "shuffle",
    "sampler_gen",
    "batch_sampler_gen",
    "distributed",
    "bucket",
    "packed",
    "mixture",
    "mixture_batches",
    "mixture_scheduled",
]
KINDS = [*MAP_KINDS, "sharded"]
EXPLICIT = {
    "distributed",
    "bucket",
    "packed",
    "sharded",
    "mixture",
    "mixture_batches",
    "mixture_scheduled",
}  # the loop calls set_epoch
ELASTIC = {"bucket", "sharded", "mixture_batches", "mixture_scheduled"}
THREADED = {
    "shuffle",
    "sampler_gen",
    "batch_sampler_gen",
    "distributed",
    "bucket",
    "mixture",
    "mixture_batches",
    "mixture_scheduled",
}  # Ids: also a ThreadLoader

settings.register_profile(
    "thorough",
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "default-suite",
    max_examples=12,
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default-suite"))


def _armed(marker: Path, value: int) -> bool:
    """True once, in a worker, when `marker` names `value` (the file is consumed)."""
    if get_worker_info() is None or not marker.exists():
        return False
    try:
        armed = int(marker.read_text() or -1)
    except (OSError, ValueError):
        return False
    if armed != value:
        return False
    try:
        marker.unlink()
    except FileNotFoundError:
        return False
    return True


class Ids(Dataset):
    """Item i is i; a worker SIGKILLs itself fetching the index its marker file names."""

    def __init__(self, n: int, marker: str):
        self.n, self.marker = n, Path(marker)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if _armed(self.marker, int(i)):
            os.kill(os.getpid(), signal.SIGKILL)
        return int(i)

    # ThreadBatched: `make_loader(..., path="threads")` reads whole batches in pool threads
    def thread_batches(self):
        return True

    def read_batch(self, indices, rng):
        return torch.tensor([int(i) for i in indices])


class ShardReader:
    """Reads a shard of ints; a worker SIGKILLs itself reading the value its marker names."""

    def __init__(self, marker: str):
        self.marker = Path(marker)

    def __call__(self, path, start, stop):
        values = [int(x) for x in Path(path).read_text().split()][start:stop]
        if get_worker_info() is not None and self.marker.exists():
            try:
                armed = int(self.marker.read_text())
            except (OSError, ValueError):
                armed = None
            if armed in values and _armed(self.marker, armed):
                os.kill(os.getpid(), signal.SIGKILL)
        return values


class World:
    """Builds the loaders of one kind: per rank, in any configuration, plain or robust."""

    def __init__(self, folder: Path, token_cache):
        self.folder, self.cache = folder, token_cache
        self.marker = str(folder / "kill")
        self.shards = make_int_shards(folder / "shards", SHARDS)

    def build(
        self, kind: str, config: dict, *, world: int = 1, rank: int = 0, rebuilt: bool = False
    ):
        workers, persistent, prefetch, robust = (
            config["workers"],
            config["persistent"],
            config["prefetch"],
            config["robust"] and config["workers"] > 0,
        )
        threads = config.get("threads", False) and kind in THREADED and not robust
        # the thread path in this process, or isolated in a child process (IsolatedLoader)
        kwargs = (
            dict(path=threads if isinstance(threads, str) else "threads")
            if threads
            else dict(num_workers=workers)
        )
        if workers and not threads:
            kwargs.update(persistent_workers=persistent, prefetch_factor=prefetch)
        torch.manual_seed(999 if rebuilt else SEED)  # a resumed process need not seed alike
        # only a RobustLoader's workers may be killed: the others read a marker never armed
        marker = self.marker if robust else str(self.folder / "never")
        ds, extra = self._data(kind, world, rank, rebuilt, marker)
        if robust and workers:
            return RobustLoader(ds, timeout=30, ladder=None, **extra, **kwargs)
        return make_loader(ds, **extra, **kwargs)

    def _data(self, kind, world, rank, rebuilt, marker):
        ds = Ids(N, marker)
        generator = torch.Generator().manual_seed(77 if rebuilt else 7)
        if kind == "shuffle":
            return ds, {"batch_size": 4, "shuffle": True}
        if kind == "sampler_gen":
            return ds, {"batch_size": 4, "sampler": RandomSampler(ds, generator=generator)}
        if kind == "batch_sampler_gen":
            return ds, {
                "batch_sampler": BatchSampler(RandomSampler(ds, generator=generator), 5, False)
            }
        if kind == "distributed":
            return ds, {
                "batch_size": 3,
                "sampler": DistributedSampler(ds, num_replicas=2, rank=0, seed=3),
            }
        if kind == "bucket":
            lengths = np.random.default_rng(0).integers(5, 60, N)
            return ds, {
                "batch_sampler": LengthBucketSampler(
                    lengths, batch_size=4, seed=4, num_replicas=world, rank=rank
                )
            }
        if (
            kind == "mixture"
        ):  # two sources (indices 0-19 and 20-47) at 0.6 / 0.4, every sample once
            return ds, {"batch_size": 4, "sampler": MixtureSampler([20, 28], [0.6, 0.4], seed=6)}
        if (
            kind == "mixture_batches"
        ):  # the batch mode: global batches dealt over the ranks, elastic
            return ds, {
                "batch_sampler": MixtureSampler(
                    [20, 28], [0.6, 0.4], seed=6, batch_size=4, num_replicas=world, rank=rank
                )
            }
        if kind == "mixture_scheduled":  # paced by a token schedule (issue 48), elastic
            lengths = np.random.default_rng(1).integers(5, 60, N)
            schedule = Schedule(
                [(0.0, [0.8, 0.2]), (0.5, [0.3, 0.7])], over="tokens", total=int(3 * lengths.sum())
            )
            return ds, {
                "batch_sampler": MixtureSampler(
                    [20, 28],
                    schedule,
                    lengths=lengths,
                    seed=6,
                    batch_size=4,
                    num_replicas=world,
                    rank=rank,
                )
            }
        if kind == "packed":
            from recipes.nlp.packing import PackCollate, PackedBatchSampler, PackedTokens

            sampler = PackedBatchSampler(self.cache.lengths, seq_len=64, batch_size=2, seed=5)
            return PackedTokens(self.cache, sampler), {
                "batch_sampler": sampler,
                "collate_fn": PackCollate(64, 2),
            }
        sharded = ShardedIterableDataset(
            self.shards,
            ShardReader(marker),
            shard_lengths=SHARDS,
            seed=2,
            rank=rank,
            world_size=world,
        )
        return sharded, {"batch_size": 4}


def key(batch) -> tuple:
    if isinstance(batch, dict):
        return tuple(batch["input_ids"].flatten().tolist())
    return tuple(torch.as_tensor(batch).flatten().tolist())


def set_epoch(loader, epoch: int) -> None:
    inner = getattr(loader, "loader", loader)
    for holder in (inner.dataset, inner.batch_sampler, inner.sampler):
        if hasattr(holder, "set_epoch") and hasattr(holder, "epoch"):
            holder.set_epoch(epoch)
            return


def num_workers(loader) -> int:
    return getattr(loader, "loader", loader).num_workers


def _live_workers(loader) -> list:
    """A RobustLoader's live persistent workers (they outlive the epoch)."""
    iterator = getattr(loader.loader, "_iterator", None)
    return [w for w in getattr(iterator, "_workers", []) if w.is_alive()]


class References:
    """Uninterrupted runs, one per (kind, world, rank, workers): epoch e is the e-th pass."""

    def __init__(self, world_builder: World):
        self.world, self.runs = world_builder, {}

    def epoch(self, kind, epoch, world=1, rank=0, workers=0) -> list[tuple]:
        workers = workers if kind == "sharded" else 0  # map-style order never depends on workers
        run = self.runs.setdefault((kind, world, rank, workers), {"loader": None, "epochs": []})
        if run["loader"] is None:
            run["loader"] = self.world.build(
                kind,
                {"workers": workers, "persistent": True, "prefetch": 2, "robust": False},
                world=world,
                rank=rank,
            )
        while len(run["epochs"]) <= epoch:
            e = len(run["epochs"])
            if kind in EXPLICIT:
                set_epoch(run["loader"], e)
            run["epochs"].append([key(b) for b in run["loader"]])
        return run["epochs"][epoch]


CONFIGS = st.fixed_dictionaries(
    {
        "workers": st.sampled_from([0, 1, 2]),
        "persistent": st.booleans(),
        "prefetch": st.sampled_from([1, 2, 4]),
        "robust": st.booleans(),
        "threads": st.sampled_from([False, "threads", "isolated"]),
    }
)


class ExactlyOnce(RuleBasedStateMachine):
    world_builder: World
    references: References
    robust_only = False  # `DeathsAtAnyMoment`: every loader a RobustLoader with persistent workers

    def _config(self, config: dict) -> dict:
        if self.robust_only:
            return {
                **config,
                "robust": True,
                "persistent": True,
                "workers": max(1, config["workers"]),
            }
        return config

    @initialize(kind=st.sampled_from(KINDS), config=CONFIGS)
    def start(self, kind, config):
        config = self._config(config)
        self.kind, self.epoch, self.world = kind, 0, 1
        self.loaders = [self.world_builder.build(kind, config)]
        self.iterators = [None]
        self.finished = False
        self.paused = False  # the loop left the epoch with `break`
        self.received = [[]]  # per rank, this epoch
        self.began_with = num_workers(self.loaders[0])
        self.resized = None  # (old world, phases) when the ranks changed this epoch
        if kind in EXPLICIT:
            set_epoch(self.loaders[0], 0)

    # ---- the loop ----------------------------------------------------------------------
    @precondition(lambda self: not self.finished and not self.paused)
    @rule(k=st.integers(1, 6))
    def take(self, k):
        for _ in range(k):
            got = []
            for r, loader in enumerate(self.loaders):
                if self.iterators[r] is None:
                    self.iterators[r] = iter(loader)
                got.append(next(self.iterators[r], None))
            if all(b is None for b in got):
                self.finished = True
                self.iterators = [None] * self.world
                return
            assert all(b is not None for b in got), "ranks ended at different steps"
            if not self.received[
                0
            ]:  # an epoch's order is fixed by the loader that yields its first batch
                self.began_with = num_workers(self.loaders[0])
            for r, batch in enumerate(got):
                self.received[r].append(key(batch))
            if self.resized is not None:
                self.resized[1][-1][1] += 1

    @precondition(lambda self: self.finished or (self.paused and self.kind in EXPLICIT))
    @rule()
    def next_epoch(self):
        if (
            self.paused
        ):  # the loop moves on after its break: the rest of the epoch dropped, by its choice
            expected = self.references.epoch(self.kind, self.epoch, 1, 0, self.began_with)
            assert self.received[0] == expected[: len(self.received[0])]
            self.received[0], self.paused = list(expected), False
        self.check_epoch()
        self.epoch += 1
        self.finished, self.received, self.resized = False, [[] for _ in range(self.world)], None
        self.began_with = num_workers(self.loaders[0])
        if self.kind in EXPLICIT:
            for loader in self.loaders:
                set_epoch(loader, self.epoch)

    @precondition(
        lambda self: (
            self.world == 1
            and self.resized is None
            and not self.finished
            and not self.paused
            and self.received[0]
        )
    )
    @rule()
    def break_out(self):
        """The loop leaves the epoch early (`break` at a step limit): a pause, not an end (issue
        #28). A checkpoint then resumes the rest (`save_and_rebuild`); or, with a set_epoch
        sampler, the loop moves on to the next epoch (`next_epoch`)."""
        self.iterators = [None]
        self.paused = True

    @rule(config=CONFIGS)
    def save_and_rebuild(self, config):
        config = self._config(config)
        if self.world > 1:
            config = {**config, "workers": min(config["workers"], 1), "robust": False}
        state = json.loads(
            json.dumps(self.loaders[0].state_dict())
        )  # plain JSON, as a checkpoint holds it
        self.paused = False  # a paused epoch resumes its rest in the rebuilt loader
        self._replace(
            [
                self.world_builder.build(self.kind, config, world=self.world, rank=r, rebuilt=True)
                for r in range(self.world)
            ],
            state,
        )

    @precondition(lambda self: self.kind in ELASTIC and not self.finished and self.resized is None)
    @rule(world=st.sampled_from([1, 2]))
    def change_world_size(self, world):
        if self.kind == "sharded" and not (world < self.world and self.world % world == 0):
            # ShardedIterableDataset replays old ranks on fewer new ones (a divisor), not more
            return
        self.paused = False  # the rebuilt loaders resume a paused epoch's rest
        state = json.loads(json.dumps(self.loaders[0].state_dict()))
        old, done = self.world, len(self.received[0])
        config = {"workers": 0, "persistent": False, "prefetch": 2, "robust": False}
        self.resized = (old, [[old, done], [world, 0]])
        self.received = [[b for rank in self.received for b in rank]] + [
            [] for _ in range(world - 1)
        ]
        self.world = world
        self._replace(
            [
                self.world_builder.build(self.kind, config, world=world, rank=r, rebuilt=True)
                for r in range(world)
            ],
            state,
        )

    @precondition(
        lambda self: (
            self.world == 1
            and isinstance(self.loaders[0], RobustLoader)
            and not self.finished
            and num_workers(self.loaders[0]) > 0
            and self.kind != "packed"
        )
    )
    @rule(ahead=st.integers(0, 8))
    def kill_a_worker(self, ahead):
        """Arms a SIGKILL in the worker that fetches a sample of an upcoming batch."""
        plan = References.epoch(self.references, self.kind, self.epoch, workers=self.began_with)
        upcoming = plan[len(self.received[0]) + ahead :]
        if upcoming and upcoming[0]:
            Path(self.world_builder.marker).write_text(str(upcoming[0][0]))

    @precondition(
        lambda self: (
            self.world == 1
            and isinstance(self.loaders[0], RobustLoader)
            and self.loaders[0].loader.persistent_workers
        )
    )
    @rule()
    def kill_a_worker_now(self):
        """SIGKILLs a persistent worker wherever the loop is: mid-epoch between batches, after
        the epoch's last batch, between epochs (the OOM killer during validation; issue #27).
        (Before the loader's first epoch there is none yet: nothing to kill. The precondition
        reads only the machine's own state, so that Hypothesis replays it alike.)"""
        workers = _live_workers(self.loaders[0])
        if workers:
            os.kill(workers[0].pid, signal.SIGKILL)
            workers[0].join(10)

    @precondition(
        lambda self: (
            self.world == 1
            and isinstance(self.loaders[0], RobustLoader)
            and self.finished
            and num_workers(self.loaders[0]) > 0
            and self.kind != "packed"
        )
    )
    @rule()
    def kill_a_worker_at_the_next_start(self):
        """Arms a SIGKILL for the next epoch's first sample: the death comes inside `iter()`,
        while the workers prefetch."""
        workers = num_workers(self.loaders[0])
        plan = self.references.epoch(self.kind, self.epoch + 1, workers=workers)
        if plan and plan[0]:
            Path(self.world_builder.marker).write_text(str(plan[0][0]))

    def _replace(self, loaders, state):
        for loader in loaders:
            if self.kind in EXPLICIT and not self.finished:
                set_epoch(loader, self.epoch)  # as a training script does before loading
            loader.load_state_dict(state)
        self.iterators = [None] * len(loaders)
        self.loaders = loaders

    # ---- the invariant -----------------------------------------------------------------
    def check_epoch(self):
        if self.resized is None:
            for r in range(self.world):
                expected = self.references.epoch(
                    self.kind, self.epoch, self.world, r, self.began_with
                )
                assert self.received[r] == expected, (self.kind, self.epoch, r)
            if self.world == 1 and self.kind != "packed" and self.kind != "distributed":
                assert sorted(i for b in self.received[0] for i in b) == list(range(self._total()))
            return
        got = Counter(i for rank in self.received for b in rank for i in b)
        assert got == self._expected_after_resize(), (self.kind, self.epoch, self.resized)

    def _total(self):
        return sum(SHARDS) if self.kind == "sharded" else N

    def _expected_after_resize(self) -> Counter:
        old, phases = self.resized
        if self.kind == "sharded":  # the old ranks' uninterrupted epoch, replayed
            return Counter(
                i
                for r in range(old)
                for b in self.references.epoch("sharded", self.epoch, old, r, self.began_with)
                for i in b
            )
        # LengthBucketSampler, MixtureSampler's batches: the global plan; each phase deals the
        # rest, padded to its ranks
        plan = self.references.epoch(self.kind, self.epoch)  # one rank: the global list in order
        expected, position = Counter(), 0
        for ranks, steps in phases:
            rest = plan[position:]
            padded = rest + [plan[i % len(plan)] for i in range((-len(rest)) % ranks)]
            taken = padded[: steps * ranks] if steps * ranks < len(padded) else padded
            expected.update(i for b in taken for i in b)
            position = min(len(plan), position + steps * ranks)
        return expected

    @invariant()
    def ranks_step_together(self):
        assert len({len(r) for r in self.received[1:]}) <= 1

    def teardown(self):
        for loader in getattr(self, "loaders", []):
            del loader
        self.loaders, self.iterators = [], []
        Path(self.world_builder.marker).unlink(missing_ok=True)


class DeathsAtAnyMoment(ExactlyOnce):
    """The same machine, every loader a RobustLoader on persistent workers, so that the bounded
    default suite draws deaths at every moment: mid-epoch, after the last batch, between
    epochs, inside `iter()` (issue #27)."""

    robust_only = True


@pytest.fixture(scope="module")
def world_builder():
    from recipes.nlp import build_token_cache
    from recipes.testing import make_text_corpus, train_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="exactly-once-"))
    texts = make_text_corpus(120, seed=3)
    cache = build_token_cache(
        texts, train_tokenizer(texts, vocab_size=300), folder / "tok", progress=False
    )
    yield World(folder, cache)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    "machine", [ExactlyOnce, DeathsAtAnyMoment], ids=["any_loader", "deaths_at_any_moment"]
)
def test_exactly_once_in_any_epoch_at_any_point(world_builder, machine):
    import warnings

    from recipes.common import LoaderWarning

    machine.world_builder = world_builder
    machine.references = References(world_builder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LoaderWarning)  # restarts announce themselves
        warnings.simplefilter("ignore", UserWarning)
        machine.TestCase.settings = settings()
        machine.TestCase().runTest()
