"""The exactly-once state machine of `test_exactly_once.py`, run against torchdata's
`StatefulDataLoader` (issue #19), so the README can say where each loader is exact.

torchdata is never a dependency: this test is skipped without it (`pip install --no-deps
"torchdata==0.11.*"`) and marked slow. Its result is recorded, never asserted: a falsifying
example makes the test xfail with the example in its reason. torchdata needs the same worker
count on resume, and its state is not JSON (it holds tensors), so the machine rebuilds with the
example's first worker count and deep-copies the state; a rebuilt loader gets the seeds of the
first one, as a training script would rebuild it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from tests.common.resume.test_exactly_once import (
    CONFIGS,
    SEED,
    ExactlyOnce,
    Ids,
    References,
    World,
    key,
)

pytestmark = pytest.mark.slow
KINDS = ["shuffle", "sampler_gen", "batch_sampler_gen", "distributed"]


class TorchdataWorld(World):
    def build(self, kind, config, *, world=1, rank=0, rebuilt=False):
        from torchdata.stateful_dataloader import StatefulDataLoader

        workers = config["workers"]
        kwargs = dict(num_workers=workers)
        if workers:
            kwargs.update(
                persistent_workers=config["persistent"], prefetch_factor=config["prefetch"]
            )
        ds = Ids(48, str(self.folder / "never"))
        generator = torch.Generator().manual_seed(7)
        if kind == "shuffle":
            extra = {
                "batch_size": 4,
                "shuffle": True,
                "generator": torch.Generator().manual_seed(SEED),
            }
        elif kind == "sampler_gen":
            extra = {"batch_size": 4, "sampler": RandomSampler(ds, generator=generator)}
        elif kind == "batch_sampler_gen":
            extra = {
                "batch_sampler": BatchSampler(RandomSampler(ds, generator=generator), 5, False)
            }
        else:
            extra = {
                "batch_size": 3,
                "sampler": DistributedSampler(ds, num_replicas=2, rank=0, seed=3),
            }
        return StatefulDataLoader(ds, **extra, **kwargs)


class SameConfigReferences(References):
    """The uninterrupted run in the example's own configuration (torchdata's order may depend
    on the workers: its base seed and its order share the generator)."""

    config: dict = {}

    def epoch(self, kind, epoch, world=1, rank=0, workers=0):
        config = self.config
        run = self.runs.setdefault(
            (kind, tuple(sorted(config.items()))), {"loader": None, "epochs": []}
        )
        if run["loader"] is None:
            run["loader"] = self.world.build(kind, config)
        while len(run["epochs"]) <= epoch:
            if kind == "distributed":
                run["loader"].sampler.set_epoch(len(run["epochs"]))
            run["epochs"].append([key(b) for b in run["loader"]])
        return run["epochs"][epoch]


class TorchdataMachine(ExactlyOnce):
    @initialize(kind=st.sampled_from(KINDS), config=CONFIGS)
    def start(self, kind, config):
        self.config = {**config, "robust": False}
        self.references.config = self.config
        super().start(kind, self.config)

    @rule()
    def save_and_rebuild(self):
        state = copy.deepcopy(self.loaders[0].state_dict())  # not JSON: it holds tensors
        self._replace([self.world_builder.build(self.kind, self.config, rebuilt=True)], state)

    # no RobustLoader, no change of ranks: not torchdata's
    kill_a_worker = None
    change_world_size = None


def test_the_same_machine_against_torchdata(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    world = TorchdataWorld(tmp_path, None)
    TorchdataMachine.world_builder = world
    TorchdataMachine.references = SameConfigReferences(world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TorchdataMachine.TestCase.settings = settings(
            max_examples=200, stateful_step_count=30, deadline=None, phases=[Phase.generate]
        )
        try:
            TorchdataMachine.TestCase().runTest()
        except AssertionError as error:  # recorded for the README, not ours to assert
            steps = "\n".join(getattr(error, "__notes__", []))
            pytest.xfail(f"torchdata StatefulDataLoader is not exact: {str(error)[:300]}\n{steps}")
