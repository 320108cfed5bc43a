"""The records a loader state is made of: where an epoch's order was drawn from, where a pass
stands, an elastic resume's earlier shapes and replay, and the dataset copies' own states; and
the check of a state's layout version where it is read.

Use when: you read or write a part of `loader.state_dict()` (`loader_passes.py` writes them,
`StatefulLoader.load_state_dict` reads them): each part is a typed record with `from_state`
and `into` (or `to_state`), so that no key is spelled twice and no field is read by position.
Cost: a few small objects per `state_dict()` / `load_state_dict()`.
Adapt here: a new field of the state: its key in `state_keys.py`, its record here, and
`STATE_VERSION` raised when a field's meaning changes.
Trade-off: the state itself stays a plain JSON dict (a checkpoint holds no pickled objects);
the records are views over it, made where it is read or written.
Copy with: common/resume/state_keys.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import recipes.common.resume.state_keys as keys


def check_version(state: Any) -> None:
    """Raises unless `state` is a loader state of this layout (`STATE_VERSION`).

    Raises:
        ValueError: not a dict, another layout version, or no `batches_yielded`.
    """
    if (
        isinstance(state, dict)
        and state.get(keys.VERSION) == keys.STATE_VERSION
        and keys.BATCHES_YIELDED in state
    ):
        return
    message = f"not a StatefulLoader state (version {keys.STATE_VERSION}): {state!r:.200}"
    if isinstance(state, dict) and state.get(keys.VERSION) == 1:
        message += (
            "; version 1 states (recipes 0.1) resumed exactly only in a first epoch "
            "without persistent workers: resume from a checkpoint saved by this version"
        )
    raise ValueError(message)


def saved_position(state: Mapping[str, Any]) -> int:
    """The epoch position of a state's next batch: its `position`, else the batches received
    (they differ after a positioned resume, whose rest a sampler counts from its own start)."""
    return int(state.get(keys.POSITION, state[keys.BATCHES_YIELDED]))


@dataclass(frozen=True)
class Order:
    """The random state an epoch's order is drawn from: each random generator's state by its
    dotted path (`loader_state.capture`), and each stateful sampler's own `state_dict()`."""

    generators: dict[str, Any] = field(default_factory=dict)
    samplers: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> Order:
        """The order a loaded state was drawn from (an empty one when it holds none)."""
        saved = (state or {}).get(keys.ORDER) or {}
        return cls(saved.get(keys.GENERATORS, {}), saved.get(keys.SAMPLERS, {}))

    def to_state(self) -> dict[str, Any]:
        return {keys.GENERATORS: self.generators, keys.SAMPLERS: self.samplers}


class Shape(NamedTuple):
    """One shape an iterable dataset's epoch ran on before an elastic resume changed it: its
    ranks, workers per rank, the batches each rank received on it, and its nodes. Saved as a
    list (`[ranks, workers, batches, nodes]`); the dataset's `resume_after(reshaped=)` takes a
    sequence of them."""

    ranks: int
    workers: int
    batches: int
    nodes: int = 1

    @classmethod
    def from_state(cls, saved: Sequence[int]) -> Shape:
        """A saved shape: 3 numbers (states before nodes were saved: 1 node) or 4; numbers a
        later layout may add after them are ignored, as before the records were typed."""
        return cls(*(int(value) for value in list(saved)[:4]))

    def to_state(self) -> list[int]:
        return list(self)


def saved_shapes(state: Mapping[str, Any]) -> list[Shape]:
    """The earlier shapes of a state's epoch (none when it never changed shape)."""
    return [Shape.from_state(s) for s in state.get(keys.RESHAPED) or []]


@dataclass(frozen=True)
class Replay:
    """An elastic resume of an iterable dataset whose new ranks replay the old ranks' rests:
    the old position where the replay began (`batches_yielded`), the old ranks
    (`world_size`), the ranks that replay (`replay_world`) and the batches replayed so far."""

    batches_yielded: int
    world_size: Any
    replay_world: Any
    replayed: int

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Replay | None:
        """The replay a state is within, or None."""
        if not state.get(keys.REPLAYED):
            return None
        return cls(
            batches_yielded=state[keys.BATCHES_YIELDED],
            world_size=state[keys.WORLD_SIZE],
            replay_world=state[keys.REPLAY_WORLD],
            replayed=int(state[keys.REPLAYED]),
        )

    def into(self, state: dict[str, Any]) -> None:
        state[keys.BATCHES_YIELDED] = self.batches_yielded
        state[keys.WORLD_SIZE] = self.world_size
        state[keys.REPLAY_WORLD] = self.replay_world
        state[keys.REPLAYED] = self.replayed


@dataclass(frozen=True)
class DatasetStates:
    """The states of the dataset copies that made an epoch's batches (`dataset_state.py`):
    by worker (`"main"` without workers), the worker count they were kept with, and the
    round-robin's next turn (mid-epoch only)."""

    states: dict[str, Any]
    workers: int
    next_worker: int | None = None

    @classmethod
    def from_state(cls, state: Mapping[str, Any], workers: int) -> DatasetStates | None:
        """A loaded state's dataset states, or None; `workers` when it names none."""
        states = state.get(keys.DATASET_STATES)
        if states is None:
            return None
        return cls(
            states,
            int(state.get(keys.DATASET_WORKERS, workers)),
            int(state.get(keys.NEXT_WORKER, 0)),
        )

    def into(self, state: dict[str, Any]) -> None:
        state[keys.DATASET_STATES] = self.states
        state[keys.DATASET_WORKERS] = self.workers
        if self.next_worker is not None:
            state[keys.NEXT_WORKER] = self.next_worker


class KnownLength(NamedTuple):
    """The epoch length a positioned sampler's loaded state resumes (`resumed_length`), kept
    with the state it was computed for: asked again for an equal state, the sampler holds the
    rest, not a whole epoch."""

    state: dict[str, Any]
    length: int | None


class WorkerResume(NamedTuple):
    """What a resumed worker's first fetcher takes along (`dataset_state.py`): its dataset
    iterator's saved state, and whether its stream had ended."""

    iterator: Any
    ended: bool


class ResumeAt(NamedTuple):
    """Where a loader of the current shape stopped, and its settings: what a dataset's
    `resume_after` is given (`MixtureIterable`, `PackedTextStream` replay their workers from it)."""

    batches_done: int
    batch_size: int | None
    drop_last: bool
    workers: int  # the interrupted loader's (at least 1)
    interleave: bool  # another worker count resumes: the rest in one process, in the old order

    @property
    def per_batch(self) -> int:
        if self.batch_size is None:
            return 1
        return self.batch_size
