"""The passes of a `StatefulLoader`: where each epoch's order was drawn from, and how far the
loop got in it.

Use when: you read how `loader.state_dict()` is computed; `StatefulLoader` is the public face.
Cost: per pass, one capture of the sampler's random state at the draw and a check that no
global random generator was drawn from; per batch, one counter increment.
Adapt here: `_Passes.state` (what a state holds at each point of a pass).
Trade-off: a pass ends when its iterator is exhausted; a state saved after that is for the
next epoch. A loop left early (`break` at a step limit, an error or Ctrl-C in the loop body)
only pauses its pass: a state saved then resumes at the first batch the loop did not get, as
torchdata's does (issue #28), while iterating the same loader again starts the next epoch, as
DataLoader does.
A batch whose making raised (a dataset error, in a worker or a thread) counts as used: the loop
moved past it, and a resume does not make it again.
Copy with: common/loader_warning.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/loader_contract.py, common/resume/loader_state.py, common/resume/state_keys.py.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

from recipes.common.loader_warning import LoaderWarning
from recipes.common.resume.dataset_state import (
    carried_over,
    keeps_own_state,
    live_state,
    may_resume_itself,
)
from recipes.common.resume.loader_contract import (
    EpochAdvancing,
    EpochSeeded,
    ResumableIterable,
    StatefulSampler,
)
from recipes.common.resume.loader_state import (
    capture,
    find_generators,
    positioned_sampler,
    restore,
    resumed_length,
)
from recipes.common.resume.state_keys import STATE_VERSION


@dataclass
class Pass:
    """One iteration over the loader: its epoch and where it stands."""

    epoch: int
    skip: int  # batches of the epoch skipped at its start (a resume), counted in `yielded`
    position: (
        int  # the epoch position of its first batch for this loop (its draws' seeds follow it)
    )
    workers: int  # the worker count whose order this pass follows (an iterable dataset's)
    resumed: dict | None = None  # the loaded state this pass resumes
    yielded: int = 0
    done: bool = False  # the loop ended: StopIteration, or its iterator dropped
    dropped: bool = False  # left by the loop (break, or an exception): paused, its state mid-epoch
    closed: bool = False  # the loader was closed (its workers shut down) before the pass ended
    drawn: bool = False
    snapshot: dict = field(default_factory=dict)  # the random state the order was drawn from
    dataset_states: dict = field(
        default_factory=dict
    )  # worker -> its dataset copy's state (`dataset_state.py`)
    base_states: dict = field(
        default_factory=dict
    )  # the copies' states as the pass began (loaded, or carried over)
    last_worker: int | None = (
        None  # the worker that made the last batch received (its states' round-robin)
    )
    length: int | None = (
        None  # the epoch's batches here, when a positioned sampler's own count is its rest
    )
    reshaped: list | None = (
        None  # an elastic resume's earlier shapes [ranks, workers, batches] (shards)
    )
    inner: Any = None  # a weak reference to DataLoader's iterator (persistent workers share it);
    # strong, it would close a cycle: iterator -> its index sampler -> this pass -> iterator


class Passes:
    """The loader's passes and a loaded state waiting for the next one. Holds the sampler,
    batch sampler and dataset, never the loader (a loader -> iterator -> loader cycle would
    keep persistent workers alive until a garbage collection, which may run in a forked child)."""

    def __init__(self, loader):
        self.dataset = loader.dataset
        self.iterable = isinstance(loader.dataset, IterableDataset)
        self.own_state = keeps_own_state(
            loader.dataset
        )  # resumes itself: its state_dict() per worker
        self.self_resuming = may_resume_itself(
            loader.dataset
        )  # it, or its iterator, may (`dataset_state.py`)
        self.persistent = bool(loader.persistent_workers and loader.num_workers)
        roles = _roles(loader)
        self.positioned = positioned_sampler(loader.batch_sampler)
        self.known_length: list = []  # `resumed_length`'s of the loaded state
        self.holder = _epoch_holder(loader.dataset, roles)
        unreproducible: list[str] = []
        self.generators = (
            {}
            if self.iterable
            else find_generators(
                {"sampler": loader.sampler, "batch_sampler": loader.batch_sampler}, unreproducible
            )
        )
        # a sampler's own state_dict() is the order's source only when nothing else is: torchdata's
        # samplers save their position in the pass, which the loop's count already gives
        self.stateful = (
            {}
            if self.iterable
            else {
                name: s
                for name, s in roles.items()
                if s is not self.positioned
                and isinstance(s, StatefulSampler)
                and not isinstance(s, EpochSeeded)
                and _no_args(s.state_dict)
                and not find_generators({name: s})
            }
        )
        self.blind = None if self.iterable else _blind_spot(roles, self, unreproducible)
        self.current: Pass | None = None
        self.pending: dict | None = None
        self.seed: int | None = None  # the batches' seeds' (`batch_seeds.py`); set by the loader
        self.warned: set[str] = set()

    def _holder_epoch(self) -> int | None:
        return None if self.holder is None else int(self.holder.epoch)

    def _advances(
        self, epoch: int | None
    ) -> bool:  # an `EpochAdvancing` holder at the last whole pass's epoch
        last = self.current
        return bool(
            isinstance(self.holder, EpochAdvancing)
            and self.holder.advance_epochs
            and last is not None
            and last.done
            and last.epoch == epoch
        )

    # ---- a pass ------------------------------------------------------------------------
    def start(self, num_workers: int) -> Pass:
        """Begins a pass: the loaded state's, else a fresh epoch."""
        pending = self.pending
        self.pending = None
        if (
            pending is not None
            and self.holder is not None
            and self._holder_epoch() != pending["epoch"]
        ):
            pending = None  # set_epoch chose another epoch since the load: it starts afresh
        if pending is not None:
            epoch = pending["epoch"]
        elif self.holder is not None:
            epoch = self._holder_epoch()
            if self._advances(epoch):  # the loop did not move it on: the loader counts this epoch
                epoch += 1
                self.holder.set_epoch(epoch)
        else:  # a loader that counts its epochs: one per pass
            epoch = 0 if self.current is None else self.current.epoch + 1
        self._warn_same_epoch(epoch, pending)
        skip = 0 if pending is None else int(pending["batches_yielded"])
        position = (
            0 if pending is None else int(pending.get("position", pending["batches_yielded"]))
        )
        length = None  # a positioned sampler resumes by itself, on any number of ranks:
        if (
            pending is not None
            and self.positioned is not None
            and pending.get("sampler") is not None
        ):
            skip = 0
            length = resumed_length(self.positioned, pending, self.known_length)
        if (reshaped := self._reshaped(pending)) is not None and self._new_shape(pending):
            # a new shape: the rest is dealt over these ranks and workers (`shard_reshape.py`)
            skip = 0
        saved_workers = None if pending is None else pending.get("num_workers")
        if saved_workers is None or not (skip or pending.get("replayed")):
            saved_workers = (
                num_workers  # nothing received yet: the epoch follows this loader's workers
            )
        base = {}
        if pending is not None:
            base = dict(pending.get("dataset_states") or {})
        elif (
            self.self_resuming
            and self.persistent
            and self.current is not None
            and self.current.done
            and not self.current.dropped
        ):  # the copies go on from the epoch's end (after a break:
            base = carried_over(
                self.pass_states(self.current)
            )  # unknown, read ahead; fresh states)
        self.current = Pass(
            epoch,
            skip,
            position,
            int(saved_workers),
            resumed=pending,
            yielded=skip,
            base_states=base,
            length=length,
            reshaped=reshaped,
        )
        return self.current

    def _reshaped(self, pending: dict | None) -> list | None:
        """An iterable dataset's earlier shapes of the epoch when this pass resumes on a new one."""
        if pending is None or not self.iterable or not getattr(self.dataset, "reshapes", False):
            return None
        earlier = [list(s) for s in pending.get("reshaped") or []]
        world = pending.get("world_size")
        nodes = int(pending.get("nodes", 1))
        if world is not None and self._new_shape(pending) and int(pending["batches_yielded"]):
            return earlier + [
                [
                    int(world),
                    max(1, int(pending.get("num_workers") or 1)),
                    int(pending["batches_yielded"]),
                    nodes,
                ]
            ]
        return earlier or None  # the same shape, or nothing received on the old one

    def _new_shape(
        self, pending: dict
    ) -> bool:  # an iterable dataset's ranks (or nodes) not the state's
        return pending.get("world_size") != int(self.dataset.world_size) or int(
            pending.get("nodes", 1)
        ) != int(getattr(self.dataset, "nodes", 1))

    def superseded(self, current: Pass) -> bool:
        """Whether `current` must begin again before its first batch is handed over: a state was
        loaded since it began, or `set_epoch` chose another epoch after its order was drawn
        (workers draw at `iter()`; a lazy draw follows `set_epoch` itself, in `draw`). Lightning
        calls `iter()` before `set_epoch`, and may load a state after `iter()` (#20550)."""
        if current is not self.current or current.done or current.yielded != current.skip:
            return False
        if self.pending is not None:
            return True
        return self.holder is not None and current.drawn and self._holder_epoch() != current.epoch

    def draw(self, current: Pass) -> None:
        """At the first index of a pass, before the sampler draws: restores the loaded random
        state, then captures the one this order is drawn from."""
        if self.holder is not None and self._holder_epoch() != current.epoch:
            # set_epoch between iter() and the first batch (no workers: the order is drawn now)
            current.epoch = self._holder_epoch()
            current.resumed = None
            current.skip = 0
            current.yielded = 0
            current.position = 0
        order = (current.resumed or {}).get("order") or {}
        restore(self.generators, order.get("generators", {}))
        for name, state in order.get("samplers", {}).items():
            if name not in self.stateful:
                raise ValueError(
                    f"This loader state holds the state of a stateful {name}, which this loader "
                    "does not have; build the loader with the same sampler as the run that saved "
                    "it."
                )
            self.stateful[name].load_state_dict(state)
        current.snapshot = self._capture()
        current.drawn = True

    def _capture(self) -> dict[str, Any]:
        return {
            "generators": capture(self.generators),
            "samplers": {name: s.state_dict() for name, s in self.stateful.items()},
        }

    # ---- state -------------------------------------------------------------------------
    def load(self, state: dict[str, Any]) -> None:
        self.pending = dict(state)
        if self.holder is not None:
            self.holder.set_epoch(int(state["epoch"]))

    def state(self) -> dict[str, Any]:
        self._warn_blind()
        pending = self.pending
        current = self.current
        epoch = self._holder_epoch()
        if pending is not None:
            if self.holder is None or epoch == pending["epoch"]:
                return {k: v for k, v in pending.items() if k != "plan"}
            return self._fresh(epoch)
        if current is None:
            return self._fresh(0 if epoch is None else epoch)
        if current.done and not current.dropped:
            # the next pass is the sampler's epoch when set_epoch says which
            following = epoch + 1 if self._advances(epoch) else epoch  # what the next pass starts
            fresh = self._fresh(
                following if self.holder is not None else current.epoch + 1, finished=current.epoch
            )
            if self.self_resuming:
                self._carried_states(fresh, current)
            return fresh
        if (
            (current.dropped or not current.drawn)
            and self.holder is not None
            and epoch != current.epoch
        ):
            return self._fresh(
                epoch
            )  # set_epoch moved on: from a paused pass, or before the (lazy) first draw
        state = {
            "version": STATE_VERSION,
            "epoch": current.epoch,
            "batches_yielded": current.yielded,
            "num_workers": current.workers,
            "order": current.snapshot
            if current.drawn
            else ((current.resumed or {}).get("order") or self._capture()),
        }
        position = (
            current.position + current.yielded - current.skip
        )  # differs after a positioned resume
        if position != current.yielded:
            state["position"] = position
        if self.positioned is not None:
            state["sampler"] = self.positioned.state_dict(batches_done=current.yielded)
        if self.iterable and isinstance(self.dataset, ResumableIterable):
            self._iterable_position(state, current)
        elif self.self_resuming:
            self._dataset_states(state, current)
        return state

    def pass_states(self, current: Pass) -> dict[str, Any]:
        """Each worker's dataset copy's state after its last batch (or stream end) the loop
        received, over the states the pass began with."""
        return {
            **current.base_states,
            **{str(w): s for w, s in current.dataset_states.items() if w != "main"},
        }

    def keep_main_state(self, current: Pass, inner) -> None:
        """Without workers, as a pass ends or is left: this process's copy's state, which its
        iterator (gone after the loop) holds."""
        if self.self_resuming and not current.workers and not current.done:
            current.dataset_states["main"] = live_state(self.dataset, inner)

    def _main_state(self, current: Pass) -> dict[str, Any] | None:
        inner = current.inner() if current.inner is not None else None
        if inner is None and "main" in current.dataset_states:
            return current.dataset_states["main"]
        return live_state(self.dataset, inner)

    def _dataset_states(self, state: dict[str, Any], current: Pass) -> None:
        """Mid-epoch: the states of the dataset copies that made the batches received (this
        process's without workers); none when the dataset and its iterator keep none."""
        if not current.workers:
            own = self._main_state(current)
            if own is not None:
                state.update(dataset_states={"main": own}, dataset_workers=0)
            return
        states = self.pass_states(current)
        if not states or any(s is None for s in states.values()):
            # no state of its own: the epoch's first batches are read again (`stateful_loader.py`)
            return
        resumed = current.resumed or {}
        state.update(dataset_states=states, dataset_workers=current.workers)
        # the round-robin's next turn: after the worker that made the last batch (or end) received
        state["next_worker"] = (
            resumed.get("next_worker", 0)
            if current.last_worker is None
            else (current.last_worker + 1) % current.workers
        )

    def _carried_states(self, state: dict[str, Any], current: Pass) -> None:
        """After an epoch: the dataset states of the copies that outlive it (persistent
        workers'; this process's), which the next epoch's copies begin with."""
        if not current.workers:
            carried = carried_over({"main": self._main_state(current)})
        else:
            carried = carried_over(self.pass_states(current)) if self.persistent else {}
        if carried:
            state.update(dataset_states=carried, dataset_workers=current.workers)

    def _fresh(self, epoch: int, *, finished: int | None = None) -> dict[str, Any]:
        """The state of a pass not begun: `epoch` from its start. `finished_epoch` names the
        epoch whose loop ended last (so a script knows where it stands: with a `set_epoch`
        sampler not moved on since, `epoch == finished_epoch` and the script's next epoch is
        `finished_epoch + 1`)."""
        state = {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches_yielded": 0,
            "finished_epoch": finished,
            "num_workers": None,
            "order": self._capture(),
        }
        if self.iterable and isinstance(self.dataset, ResumableIterable):
            state["world_size"] = int(self.dataset.world_size)
            if int(getattr(self.dataset, "nodes", 1)) > 1:
                state["nodes"] = int(self.dataset.nodes)
        return state

    def _iterable_position(self, state: dict[str, Any], current: Pass) -> None:
        """An iterable dataset's ranks; a pass that replays other ranks' rests (an elastic
        resume) saves where that replay began and how far it got."""
        resumed = current.resumed or {}
        old_world = resumed.get("world_size")
        world = int(self.dataset.world_size)
        state["world_size"] = world
        if int(getattr(self.dataset, "nodes", 1)) > 1:  # node-affine: the nodes shape the plan too
            state["nodes"] = int(self.dataset.nodes)
        if current.reshaped is not None:  # within an elastic resume's rest: the earlier shapes
            state["reshaped"] = current.reshaped
            return
        if (
            old_world is not None
            and old_world != world
            and (current.skip or resumed.get("replayed"))
        ):
            state.update(
                batches_yielded=current.skip,
                world_size=old_world,
                replay_world=world,
                replayed=int(resumed.get("replayed", 0)) + current.yielded - current.skip,
            )
        elif resumed.get("replayed"):
            state.update(
                batches_yielded=current.skip,
                world_size=resumed["world_size"],
                replay_world=resumed["replay_world"],
                replayed=int(resumed["replayed"]) + current.yielded - current.skip,
            )

    # ---- warnings ----------------------------------------------------------------------
    def _warn_same_epoch(self, epoch: int, pending) -> None:
        """A `set_epoch`-seeded order (or a dataset that resumes itself) iterated again at the epoch
        its last whole pass had: the same order again, or worse."""
        last = self.current
        if (
            self.holder is None
            or pending is not None
            or last is None
            or not last.done
            or last.dropped
            or last.epoch != epoch
            or "same_epoch" in self.warned
        ):
            return
        if not self.own_state:
            if getattr(self.holder, "shuffle", True) is False:
                return  # an order that never changes: nothing repeats that would not anyway
            self.warned.add("same_epoch")
            warnings.warn(
                f"{type(self.holder).__name__} is iterated again at epoch {epoch}, the epoch of "
                "the last pass: it gives the same order as that pass. Call its set_epoch(epoch) "
                "before each epoch (as with DistributedSampler).",
                LoaderWarning,
                stacklevel=4,
            )
            return
        self.warned.add("same_epoch")
        warnings.warn(
            f"{type(self.dataset).__name__} is iterated again at epoch {epoch}, the epoch of its "
            "last pass: call its set_epoch(epoch) before each epoch. A dataset that resumes "
            "itself may otherwise start where a loaded state left it (Hugging Face's "
            "IterableDataset applies a loaded state again while its epoch is unchanged): samples "
            "lost.",
            LoaderWarning,
            stacklevel=4,
        )

    def _warn_blind(self) -> None:
        if self.blind and "blind" not in self.warned:
            self.warned.add("blind")
            warnings.warn(self.blind, LoaderWarning, stacklevel=4)

    def warn_global(self, sampler, which: list[str]) -> None:
        if type(sampler) is BatchSampler:  # name the user's sampler, not torch's batching around it
            sampler = sampler.sampler
        if "global" not in self.warned:
            self.warned.add("global")
            warnings.warn(
                f"{type(sampler).__name__} drew its order from {' and '.join(which)} global random "
                "generator, which a loader state cannot restore (the training step draws from it "
                "too): a resumed run would see another order, repeating and losing samples. Give "
                "the sampler a generator of its own (for example RandomSampler(dataset, "
                "generator=torch.Generator().manual_seed(seed))), make it set_epoch-seeded, or "
                "use make_loader(..., shuffle=True).",
                LoaderWarning,
                stacklevel=4,
            )


def _roles(loader) -> dict[str, Any]:
    """The loader's samplers by role, each object once."""
    roles: dict[str, Any] = {}
    for name, obj in (
        ("batch_sampler", loader.batch_sampler),
        ("sampler", loader.sampler),
        ("batch_sampler.sampler", getattr(loader.batch_sampler, "sampler", None)),
    ):
        if obj is not None and all(obj is not seen for seen in roles.values()):
            roles[name] = obj
    return roles


def _epoch_holder(dataset, roles: dict[str, Any]):
    """What carries the epoch: an iterable dataset, the batch sampler, or the sampler."""
    candidates = [dataset] if isinstance(dataset, IterableDataset) else list(roles.values())
    for holder in candidates:
        if isinstance(holder, EpochSeeded):
            return holder
    return None


def _no_args(method) -> bool:
    try:
        return all(
            p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in inspect.signature(method).parameters.values()
        )
    except (TypeError, ValueError):
        return False


_DETERMINISTIC = (SequentialSampler, range, list, tuple)


def _blind_spot(roles: dict[str, Any], passes: Passes, unreproducible: list[str]) -> str | None:
    """A warning for a sampler whose random state the loader cannot see, or None."""
    if unreproducible:
        return (
            f"loader.state_dict() cannot reproduce {', '.join(unreproducible)}: a "
            "random.SystemRandom draws from the operating system's entropy, which no state can "
            "replay. Use a seeded random.Random or torch.Generator for the order."
        )
    if (
        passes.holder is not None
        or passes.positioned is not None
        or passes.generators
        or passes.stateful
    ):
        return None
    for name, sampler in roles.items():
        if isinstance(sampler, _DETERMINISTIC) or type(sampler) is BatchSampler:
            continue
        half = (
            " It has set_epoch() but no `epoch` attribute: set self.epoch in set_epoch."
            if hasattr(sampler, "set_epoch")
            else ""
        )
        return (
            f"loader.state_dict() cannot see the random state of the {name} "
            f"{type(sampler).__name__}: it holds no random generator as an attribute, has no "
            "set_epoch()/epoch and no state_dict()."
            + half
            + " If its order is random, a resume will not reproduce it. Give it a "
            "torch.Generator attribute, a (seed, epoch)-seeded order with set_epoch(), or "
            "state_dict()/load_state_dict() (see recipes.common.resume.loader_contract)."
        )
    return None
