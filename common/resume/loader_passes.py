"""The passes of a `StatefulLoader`: each epoch's pass, where the loop got in it, and the
state computed from them.

Use when: you read how `loader.state_dict()` is computed; `StatefulLoader` is the public face.
Cost: per pass, one capture of the sampler's random state at the draw and a check that no
global random generator was drawn from; per batch, one counter increment.
Adapt here: `Passes.state` (what a state holds at each point of a pass).
Trade-off: a pass ends when its iterator is exhausted; a state saved after that is for the
next epoch. A loop left early (`break` at a step limit, an error or Ctrl-C in the loop body)
only pauses its pass: a state saved then resumes at the first batch the loop did not get, as
torchdata's does (issue #28), while iterating the same loader again starts the next epoch, as
DataLoader does.
A batch whose making raised (a dataset error, in a worker or a thread) counts as used: the loop
moved past it, and a resume does not make it again.
Where the order is drawn from is `order_sources.py`; an iterable dataset's ranks and an elastic
resume's rest are `elastic_rest.py`; the state's parts are the records of `state_records.py`.
Copy with: common/loader_warning.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

import recipes.common.resume.state_keys as keys
from recipes.common.resume.dataset_state import (
    carried_over,
    keeps_own_state,
    live_state,
    may_resume_itself,
)
from recipes.common.resume.elastic_rest import is_new_shape, rest_shapes, write_rest, write_shape
from recipes.common.resume.loader_contract import EpochAdvancing, ResumableIterable
from recipes.common.resume.loader_state import resumed_length
from recipes.common.resume.order_sources import OrderSources
from recipes.common.resume.state_keys import STATE_VERSION
from recipes.common.resume.state_records import (
    DatasetStates,
    KnownLength,
    Order,
    Shape,
    check_version,
    saved_position,
)

__all__ = ["STATE_VERSION", "Pass", "Passes"]


@dataclass
class Pass:
    """One iteration over the loader: its epoch and where it stands."""

    epoch: int
    # batches of the epoch skipped at its start (a resume), counted in `yielded`
    skip: int
    # the epoch position of its first batch for this loop (its draws' seeds follow it)
    position: int
    # the worker count whose order this pass follows (an iterable dataset's)
    workers: int
    # the loaded state this pass resumes
    resumed: dict | None = None
    yielded: int = 0
    # the loop ended: StopIteration, or its iterator dropped
    done: bool = False
    # left by the loop (break, or an exception): paused, its state mid-epoch
    dropped: bool = False
    # the loader was closed (its workers shut down) before the pass ended
    closed: bool = False
    drawn: bool = False
    # the random state the order was drawn from (None before the draw, and for an iterable
    # dataset, whose order is its own)
    snapshot: Order | None = None
    # worker -> its dataset copy's state (`dataset_state.py`)
    dataset_states: dict = field(default_factory=dict)
    # the copies' states as the pass began (loaded, or carried over)
    base_states: dict = field(default_factory=dict)
    # the worker that made the last batch received (its states' round-robin)
    last_worker: int | None = None
    # the epoch's batches here, when a positioned sampler's own count is its rest
    length: int | None = None
    # an elastic resume's earlier shapes (shards)
    reshaped: list[Shape] | None = None
    # a weak reference to DataLoader's iterator (persistent workers share it); strong, it
    # would close a cycle: iterator -> its index sampler -> this pass -> iterator
    inner: Any = None

    def main_iterator(self):
        """DataLoader's iterator of this pass while it lives, else None."""
        if self.inner is None:
            return None
        return self.inner()


class Passes:
    """The loader's passes and a loaded state waiting for the next one. Holds the sampler,
    batch sampler and dataset, never the loader (a loader -> iterator -> loader cycle would
    keep persistent workers alive until a garbage collection, which may run in a forked child)."""

    def __init__(self, loader):
        self.dataset = loader.dataset
        self.iterable = isinstance(loader.dataset, IterableDataset)
        # resumes itself: its state_dict() per worker
        self.own_state = keeps_own_state(loader.dataset)
        # it, or its iterator, may (`dataset_state.py`)
        self.self_resuming = may_resume_itself(loader.dataset)
        self.persistent = bool(loader.persistent_workers and loader.num_workers)
        self.sources = OrderSources(loader, iterable=self.iterable)
        self.positioned = self.sources.positioned
        self.holder = self.sources.holder
        self.known_length: KnownLength | None = None  # `resumed_length`'s of the loaded state
        self.current: Pass | None = None
        self.pending: dict | None = None
        self.seed: int | None = None  # the batches' seeds' (`batch_seeds.py`); set by the loader
        self.warned: set[str] = set()

    def _advances(self, epoch: int | None) -> bool:
        """Whether an `EpochAdvancing` holder is at the last whole pass's epoch."""
        last = self.current
        return bool(
            isinstance(self.holder, EpochAdvancing)
            and self.holder.advance_epochs
            and last is not None
            and last.done
            and last.epoch == epoch
        )

    def _repeats(self, epoch: int) -> bool:
        """Whether a pass at `epoch` follows a whole pass at the same epoch of an epoch holder."""
        last = self.current
        if self.holder is None or last is None:
            return False
        return last.done and not last.dropped and last.epoch == epoch

    def resumed_length(self, pending: dict) -> int | None:
        """The epoch's batches a positioned sampler resumes from `pending` (`resumed_length`)."""
        self.known_length = resumed_length(self.positioned, pending, self.known_length)
        return self.known_length.length

    # ---- a pass ------------------------------------------------------------------------
    def start(self, num_workers: int) -> Pass:
        """Begins a pass: the loaded state's, else a fresh epoch."""
        pending = self.pending
        self.pending = None
        holder_epoch = self.sources.holder_epoch()
        if pending is not None and self.holder is not None:
            if holder_epoch != pending[keys.EPOCH]:
                pending = None  # set_epoch chose another epoch since the load: it starts afresh
        epoch = self._next_epoch(pending)
        if pending is None and self._repeats(epoch):
            self.sources.warn_same_epoch(epoch, self.dataset, own_state=self.own_state)
        if pending is None:
            self.current = Pass(epoch, 0, 0, int(num_workers), base_states=self._carried_base())
            return self.current
        skip = int(pending[keys.BATCHES_YIELDED])
        length = None
        # a positioned sampler resumes by itself, on any number of ranks
        if self.positioned is not None and pending.get(keys.SAMPLER) is not None:
            skip = 0
            length = self.resumed_length(pending)
        reshaped = rest_shapes(self.dataset, pending)
        if reshaped is not None and is_new_shape(self.dataset, pending):
            # a new shape: the rest is dealt over these ranks and workers (`shard_reshape.py`)
            skip = 0
        saved_workers = pending.get(keys.NUM_WORKERS)
        if saved_workers is None or not (skip or pending.get(keys.REPLAYED)):
            # nothing received yet: the epoch follows this loader's workers
            saved_workers = num_workers
        self.current = Pass(
            epoch,
            skip,
            saved_position(pending),
            int(saved_workers),
            resumed=pending,
            yielded=skip,
            base_states=dict(pending.get(keys.DATASET_STATES) or {}),
            length=length,
            reshaped=reshaped,
        )
        return self.current

    def _next_epoch(self, pending: dict | None) -> int:
        """The epoch a pass begins: the loaded state's, the holder's, else the loader's count."""
        if pending is not None:
            return pending[keys.EPOCH]
        if self.holder is not None:
            epoch = self.sources.holder_epoch()
            if self._advances(epoch):  # the loop did not move it on: the loader counts this epoch
                epoch += 1
                self.holder.set_epoch(epoch)
            return epoch
        if self.current is None:  # a loader that counts its epochs: one per pass
            return 0
        return self.current.epoch + 1

    def _carried_base(self) -> dict:
        """The states a fresh pass's dataset copies begin with: after a whole epoch with
        persistent workers, they go on from its end (after a break: unknown, read ahead; fresh
        states)."""
        last = self.current
        if not (self.self_resuming and self.persistent) or last is None:
            return {}
        if not last.done or last.dropped:
            return {}
        return carried_over(self.pass_states(last))

    def superseded(self, current: Pass) -> bool:
        """Whether `current` must begin again before its first batch is handed over: a state was
        loaded since it began, or `set_epoch` chose another epoch after its order was drawn
        (workers draw at `iter()`; a lazy draw follows `set_epoch` itself, in `draw`). Lightning
        calls `iter()` before `set_epoch`, and may load a state after `iter()` (#20550)."""
        if current is not self.current or current.done or current.yielded != current.skip:
            return False
        if self.pending is not None:
            return True
        if self.holder is None or not current.drawn:
            return False
        return self.sources.holder_epoch() != current.epoch

    def draw(self, current: Pass) -> None:
        """At the first index of a pass, before the sampler draws: restores the loaded random
        state, then captures the one this order is drawn from."""
        holder_epoch = self.sources.holder_epoch()
        if self.holder is not None and holder_epoch != current.epoch:
            # set_epoch between iter() and the first batch (no workers: the order is drawn now)
            current.epoch = holder_epoch
            current.resumed = None
            current.skip = 0
            current.yielded = 0
            current.position = 0
        self.sources.restore(Order.from_state(current.resumed))
        current.snapshot = self.sources.capture()
        current.drawn = True

    # ---- state -------------------------------------------------------------------------
    def load(self, state: dict[str, Any]) -> None:
        """Keeps a loaded state for the next pass; its layout version is checked here, where it
        is read.

        Raises:
            ValueError: not a loader state of this layout version.
        """
        check_version(state)
        self.pending = dict(state)
        if self.holder is not None:
            self.holder.set_epoch(int(state[keys.EPOCH]))

    def state(self) -> dict[str, Any]:
        """Where the loop stands, as a plain JSON loader state (less the loader's `plan` and
        `batch_seed`, which `StatefulLoader.state_dict` adds)."""
        self.sources.warn_blind()
        pending = self.pending
        current = self.current
        epoch = self.sources.holder_epoch()
        if pending is not None:
            if self.holder is None or epoch == pending[keys.EPOCH]:
                return {k: v for k, v in pending.items() if k != keys.PLAN}
            return self._fresh(epoch)
        if current is None:
            if epoch is None:
                return self._fresh(0)
            return self._fresh(epoch)
        if current.done and not current.dropped:
            return self._after_epoch(current, epoch)
        if self.holder is not None and epoch != current.epoch:
            if current.dropped or not current.drawn:
                # set_epoch moved on: from a paused pass, or before the (lazy) first draw
                return self._fresh(epoch)
        return self._mid_epoch(current)

    def _after_epoch(self, current: Pass, epoch: int | None) -> dict[str, Any]:
        """The state after a whole pass: the next pass from its start. The next pass is the
        sampler's epoch when set_epoch says which."""
        following = current.epoch + 1
        if self.holder is not None:
            following = epoch
            if self._advances(epoch):
                following = epoch + 1
        fresh = self._fresh(following, finished=current.epoch)
        if self.self_resuming:
            self._carried_states(fresh, current)
        return fresh

    def _mid_epoch(self, current: Pass) -> dict[str, Any]:
        """The state of a pass begun (or paused): its epoch and the batches the loop received."""
        if current.snapshot is not None:
            order = current.snapshot.to_state()
        elif current.drawn:
            order = {}  # an iterable dataset's order is its own: nothing was drawn here
        else:
            order = (current.resumed or {}).get(keys.ORDER) or self.sources.capture().to_state()
        state = {
            keys.VERSION: STATE_VERSION,
            keys.EPOCH: current.epoch,
            keys.BATCHES_YIELDED: current.yielded,
            keys.NUM_WORKERS: current.workers,
            keys.ORDER: order,
        }
        # differs after a positioned resume
        position = current.position + current.yielded - current.skip
        if position != current.yielded:
            state[keys.POSITION] = position
        if self.positioned is not None:
            state[keys.SAMPLER] = self.positioned.state_dict(batches_done=current.yielded)
        if self.iterable and isinstance(self.dataset, ResumableIterable):
            write_rest(self.dataset, state, current)
        elif self.self_resuming:
            self._dataset_states(state, current)
        return state

    def pass_states(self, current: Pass) -> dict[str, Any]:
        """Each worker's dataset copy's state after its last batch (or stream end) the loop
        received, over the states the pass began with."""
        return {
            **current.base_states,
            **{str(w): s for w, s in current.dataset_states.items() if w != keys.MAIN},
        }

    def keep_main_state(self, current: Pass, inner) -> None:
        """Without workers, as a pass ends or is left: this process's copy's state, which its
        iterator (gone after the loop) holds."""
        if self.self_resuming and not current.workers and not current.done:
            current.dataset_states[keys.MAIN] = live_state(self.dataset, inner)

    def _main_state(self, current: Pass) -> dict[str, Any] | None:
        inner = current.main_iterator()
        if inner is None and keys.MAIN in current.dataset_states:
            return current.dataset_states[keys.MAIN]
        return live_state(self.dataset, inner)

    def _dataset_states(self, state: dict[str, Any], current: Pass) -> None:
        """Mid-epoch: the states of the dataset copies that made the batches received (this
        process's without workers); none when the dataset and its iterator keep none."""
        if not current.workers:
            own = self._main_state(current)
            if own is not None:
                DatasetStates({keys.MAIN: own}, 0).into(state)
            return
        states = self.pass_states(current)
        if not states or any(s is None for s in states.values()):
            # no state of its own: the epoch's first batches are read again (`stateful_loader.py`)
            return
        # the round-robin's next turn: after the worker that made the last batch (or end) received
        if current.last_worker is None:
            next_worker = (current.resumed or {}).get(keys.NEXT_WORKER, 0)
        else:
            next_worker = (current.last_worker + 1) % current.workers
        DatasetStates(states, current.workers, next_worker).into(state)

    def _carried_states(self, state: dict[str, Any], current: Pass) -> None:
        """After an epoch: the dataset states of the copies that outlive it (persistent
        workers'; this process's), which the next epoch's copies begin with."""
        carried = {}
        if not current.workers:
            carried = carried_over({keys.MAIN: self._main_state(current)})
        elif self.persistent:
            carried = carried_over(self.pass_states(current))
        if carried:
            DatasetStates(carried, current.workers).into(state)

    def _fresh(self, epoch: int, *, finished: int | None = None) -> dict[str, Any]:
        """The state of a pass not begun: `epoch` from its start. `finished_epoch` names the
        epoch whose loop ended last (so a script knows where it stands: with a `set_epoch`
        sampler not moved on since, `epoch == finished_epoch` and the script's next epoch is
        `finished_epoch + 1`)."""
        state = {
            keys.VERSION: STATE_VERSION,
            keys.EPOCH: epoch,
            keys.BATCHES_YIELDED: 0,
            keys.FINISHED_EPOCH: finished,
            keys.NUM_WORKERS: None,
            keys.ORDER: self.sources.capture().to_state(),
        }
        if self.iterable and isinstance(self.dataset, ResumableIterable):
            write_shape(self.dataset, state)
        return state
