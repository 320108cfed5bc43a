"""An iterable dataset's ranks in a loader state, and the rest of an epoch resumed on another
shape (an elastic resume: other ranks, or other nodes).

Use when: you read how a loader state records an iterable dataset's ranks, and what a pass
that resumes on a new shape saves: a dataset that `reshapes` deals the epoch's rest over the
new ranks and workers (its earlier shapes, `Shape`, travel in the state); any other resumable
dataset has the new ranks replay the old ranks' rests (`Replay`).
Cost: a few integers per state.
Adapt here: nothing; the dealing itself is the dataset's (`common/shards/shard_reshape.py`).
Trade-off: a replay reads the old ranks' rests again on the new ranks, so a state saved within
it names where the replay began and how far it got, not a position of the new shape.
Copy with: common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

import recipes.common.resume.state_keys as keys
from recipes.common.resume.state_records import Replay, Shape, saved_shapes


def dataset_nodes(dataset) -> int:
    """The nodes a (node-affine) dataset's plan is shaped by; 1 for any other."""
    return int(getattr(dataset, "nodes", 1))


def is_new_shape(dataset, state: dict[str, Any]) -> bool:
    """Whether an iterable dataset's ranks (or nodes) are not those a state was saved with."""
    if state.get(keys.WORLD_SIZE) != int(dataset.world_size):
        return True
    return int(state.get(keys.NODES, 1)) != dataset_nodes(dataset)


def rest_shapes(dataset, state: dict[str, Any] | None) -> list[Shape] | None:
    """An iterable dataset's earlier shapes of the epoch when a pass resumes it on a new one:
    the state's, and the state's own shape when some batches were received on it; None for the
    same shape, or when nothing was received on the old one."""
    if state is None or not isinstance(dataset, IterableDataset):
        return None
    if not getattr(dataset, "reshapes", False):
        return None
    earlier = saved_shapes(state)
    world = state.get(keys.WORLD_SIZE)
    received = int(state[keys.BATCHES_YIELDED])
    if world is not None and is_new_shape(dataset, state) and received:
        workers = max(1, int(state.get(keys.NUM_WORKERS) or 1))
        nodes = int(state.get(keys.NODES, 1))
        return earlier + [Shape(int(world), workers, received, nodes)]
    return earlier or None


def write_shape(dataset, state: dict[str, Any]) -> None:
    """The dataset's ranks, and its nodes when node-affine (the nodes shape the plan too)."""
    state[keys.WORLD_SIZE] = int(dataset.world_size)
    if dataset_nodes(dataset) > 1:
        state[keys.NODES] = int(dataset.nodes)


def write_rest(dataset, state: dict[str, Any], current) -> None:
    """Mid-epoch, an iterable dataset's ranks; a pass (`current`, a `loader_passes.Pass`)
    within an elastic resume's rest saves the earlier shapes, and one that replays other ranks'
    rests saves where that replay began and how far it got."""
    resumed = current.resumed or {}
    old_world = resumed.get(keys.WORLD_SIZE)
    write_shape(dataset, state)
    world = state[keys.WORLD_SIZE]
    if current.reshaped is not None:
        state[keys.RESHAPED] = [shape.to_state() for shape in current.reshaped]
        return
    this_pass = current.yielded - current.skip
    if (
        old_world is not None
        and old_world != world
        and (current.skip or resumed.get(keys.REPLAYED))
    ):
        replayed = int(resumed.get(keys.REPLAYED, 0)) + this_pass
        Replay(current.skip, old_world, world, replayed).into(state)
        return
    if resumed.get(keys.REPLAYED):
        replayed = int(resumed[keys.REPLAYED]) + this_pass
        replay = Replay(
            current.skip, resumed[keys.WORLD_SIZE], resumed[keys.REPLAY_WORLD], replayed
        )
        replay.into(state)
