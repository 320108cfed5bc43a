"""The records a loader state is made of (`common/resume/state_records.py`): each survives a
round trip through a state dict and JSON, and a state of another layout version is refused
where it is read."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

import recipes.common.resume.state_keys as keys
from recipes.common.loading.stateful_loader import StatefulLoader
from recipes.common.resume.loader_passes import Passes
from recipes.common.resume.state_records import (
    DatasetStates,
    KnownLength,
    Order,
    Replay,
    Shape,
    check_version,
    saved_position,
    saved_shapes,
)


def _through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))


def test_an_order_round_trips_through_a_state_and_json():
    order = Order({"sampler.generator": {"kind": "torch", "state": "abc"}}, {"sampler": {"n": 3}})
    state = _through_json({keys.ORDER: order.to_state()})
    assert Order.from_state(state) == order
    assert Order.from_state({}) == Order()
    assert Order.from_state(None) == Order()


def test_shapes_round_trip_as_lists_and_read_by_name():
    shapes = [Shape(ranks=4, workers=2, batches=7, nodes=2), Shape(2, 1, 3)]
    state = _through_json({keys.RESHAPED: [s.to_state() for s in shapes]})
    assert state[keys.RESHAPED] == [[4, 2, 7, 2], [2, 1, 3, 1]]
    assert saved_shapes(state) == shapes
    assert saved_shapes(state)[0].batches == 7
    assert saved_shapes({}) == []
    # a shape saved without its nodes has one
    assert Shape.from_state([3, 1, 5]).nodes == 1


def test_a_replay_round_trips_and_is_none_outside_one():
    replay = Replay(batches_yielded=5, world_size=4, replay_world=2, replayed=3)
    state: dict = {keys.VERSION: keys.STATE_VERSION}
    replay.into(state)
    assert Replay.from_state(_through_json(state)) == replay
    assert Replay.from_state({keys.BATCHES_YIELDED: 5, keys.WORLD_SIZE: 4}) is None


def test_dataset_states_round_trip_with_and_without_the_next_worker():
    mid = DatasetStates({"0": {"dataset": 1}, "1": None}, workers=2, next_worker=1)
    state: dict = {}
    mid.into(state)
    assert DatasetStates.from_state(_through_json(state), workers=5) == mid
    after = DatasetStates({keys.MAIN: {"dataset": 2}}, workers=0)
    state = {}
    after.into(state)
    assert keys.NEXT_WORKER not in state
    assert DatasetStates.from_state(state, workers=0) == DatasetStates(
        {keys.MAIN: {"dataset": 2}}, 0, 0
    )
    assert DatasetStates.from_state({}, workers=2) is None


def test_known_length_and_the_saved_position_read_by_name():
    known = KnownLength({keys.EPOCH: 0}, 12)
    assert known.length == 12
    assert saved_position({keys.BATCHES_YIELDED: 4}) == 4
    assert saved_position({keys.BATCHES_YIELDED: 4, keys.POSITION: 9}) == 9


def test_a_loader_state_round_trips_through_json():
    loader = StatefulLoader(list(range(10)), batch_size=2, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    state = _through_json(loader.state_dict())
    assert state[keys.VERSION] == keys.STATE_VERSION
    assert state[keys.BATCHES_YIELDED] == 1
    check_version(state)
    again = StatefulLoader(list(range(10)), batch_size=2, shuffle=True)
    again.load_state_dict(state)
    assert again.state_dict() == state


@pytest.mark.parametrize(
    "state",
    [
        {keys.VERSION: keys.STATE_VERSION + 1, keys.BATCHES_YIELDED: 0},
        {keys.VERSION: keys.STATE_VERSION},
        [keys.STATE_VERSION],
    ],
)
def test_the_version_check_refuses_another_layout(state):
    with pytest.raises(
        ValueError, match=f"not a StatefulLoader state \\(version {keys.STATE_VERSION}\\)"
    ):
        check_version(state)
    passes = Passes(DataLoader(list(range(4)), batch_size=2))
    with pytest.raises(ValueError, match="not a StatefulLoader state"):
        passes.load(state)
    assert passes.pending is None


def test_the_version_check_names_what_a_version_1_state_lacked():
    with pytest.raises(ValueError, match="version 1 states \\(recipes 0.1\\)"):
        check_version({keys.VERSION: 1, keys.BATCHES_YIELDED: 0})
    loader = StatefulLoader(torch.arange(4), batch_size=2)
    with pytest.raises(ValueError, match="version 1 states"):
        loader.load_state_dict({keys.VERSION: 1, keys.BATCHES_YIELDED: 0})


def test_a_saved_shape_takes_three_or_four_numbers_and_ignores_more():
    assert Shape.from_state([2, 1, 5]) == Shape(2, 1, 5, 1)
    assert Shape.from_state([2.0, 1, 5, 2]) == Shape(2, 1, 5, 2)
    assert Shape.from_state([2, 1, 5, 2, 9]) == Shape(2, 1, 5, 2)
