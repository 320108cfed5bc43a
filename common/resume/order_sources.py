"""Where a loader's epoch order is drawn from: the object that carries the epoch, the random
generators and stateful samplers a state captures, a sampler that keeps its own global position,
and what the loader cannot see.

Use when: you read what `loader.state_dict()` captures of a sampler (`OrderSources.capture`)
and restores (`OrderSources.restore`), or why a loader warns that it cannot reproduce an order
(`OrderSources.blind`).
Cost: a walk of the samplers' attributes once per loader (`loader_state.find_generators`); one
capture of the generators' states per pass.
Adapt here: `_DETERMINISTIC` (samplers whose order needs no state), and the warnings: an order
drawn from a global random generator, one the loader cannot see, one repeated at an epoch.
Trade-off: a sampler's own `state_dict()` is the order's source only when nothing else is:
torchdata's samplers save their position in the pass, which the loop's count already gives.
Copy with: common/loader_warning.py, common/resume/loader_contract.py,
  common/resume/loader_state.py, common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

from recipes.common.loader_warning import LoaderWarning
from recipes.common.resume.loader_contract import EpochSeeded, StatefulSampler
from recipes.common.resume.loader_state import (
    capture,
    find_generators,
    positioned_sampler,
    restore,
)
from recipes.common.resume.state_records import Order

_DETERMINISTIC = (SequentialSampler, range, list, tuple)


class OrderSources:
    """A loader's sources of its epoch order, found once: `holder` (what carries the epoch, or
    None), `positioned` (a sampler that keeps the global position, or None), `generators` (by
    dotted path), `stateful` (samplers whose own state is the order's source) and `blind` (a
    warning for an order the loader cannot see, or None). An iterable dataset's order is its
    own: only its epoch holder is kept."""

    def __init__(self, loader, *, iterable: bool):
        roles = _roles(loader)
        self.positioned = positioned_sampler(loader.batch_sampler)
        self.holder = _epoch_holder(loader.dataset, roles)
        self.generators: dict[str, Any] = {}
        self.stateful: dict[str, Any] = {}
        self.blind: str | None = None
        self.warned: set[str] = set()  # the warnings given, each once per loader
        if iterable:
            return
        unreproducible: list[str] = []
        self.generators = find_generators(
            {"sampler": loader.sampler, "batch_sampler": loader.batch_sampler}, unreproducible
        )
        self.stateful = {
            name: s
            for name, s in roles.items()
            if s is not self.positioned
            and isinstance(s, StatefulSampler)
            and not isinstance(s, EpochSeeded)
            and _no_args(s.state_dict)
            and not find_generators({name: s})
        }
        self.blind = self._blind_spot(roles, unreproducible)

    def holder_epoch(self) -> int | None:
        """The epoch the holder is set to, or None without a holder."""
        if self.holder is None:
            return None
        return int(self.holder.epoch)

    def capture(self) -> Order:
        """The random state the next order is drawn from."""
        return Order(
            capture(self.generators),
            {name: s.state_dict() for name, s in self.stateful.items()},
        )

    def restore(self, order: Order) -> None:
        """Sets the generators and stateful samplers to a loaded order's state.

        Raises:
            ValueError: the order holds the state of a stateful sampler this loader lacks.
        """
        restore(self.generators, order.generators)
        for name, state in order.samplers.items():
            if name not in self.stateful:
                raise ValueError(
                    f"This loader state holds the state of a stateful {name}, which this loader "
                    "does not have; build the loader with the same sampler as the run that saved "
                    "it."
                )
            self.stateful[name].load_state_dict(state)

    # ---- warnings ----------------------------------------------------------------------
    def warn_blind(self) -> None:
        """Warns once that the loader cannot see (or reproduce) the order's random state."""
        if self.blind and "blind" not in self.warned:
            self.warned.add("blind")
            warnings.warn(self.blind, LoaderWarning, stacklevel=4)

    def warn_global(self, sampler, which: list[str]) -> None:
        """Warns once that `sampler` drew its order from the global random generators `which`."""
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

    def warn_same_epoch(self, epoch: int, dataset, *, own_state: bool) -> None:
        """Warns once that a `set_epoch`-seeded order (or a dataset that resumes itself,
        `own_state`) is iterated again at the epoch its last whole pass had: the same order
        again, or worse."""
        if "same_epoch" in self.warned:
            return
        if not own_state:
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
            f"{type(dataset).__name__} is iterated again at epoch {epoch}, the epoch of its "
            "last pass: call its set_epoch(epoch) before each epoch. A dataset that resumes "
            "itself may otherwise start where a loaded state left it (Hugging Face's "
            "IterableDataset applies a loaded state again while its epoch is unchanged): samples "
            "lost.",
            LoaderWarning,
            stacklevel=4,
        )

    def _blind_spot(self, roles: dict[str, Any], unreproducible: list[str]) -> str | None:
        """A warning for a sampler whose random state the loader cannot see, or None."""
        if unreproducible:
            return (
                f"loader.state_dict() cannot reproduce {', '.join(unreproducible)}: a "
                "random.SystemRandom draws from the operating system's entropy, which no state "
                "can replay. Use a seeded random.Random or torch.Generator for the order."
            )
        if (
            self.holder is not None
            or self.positioned is not None
            or self.generators
            or self.stateful
        ):
            return None
        for name, sampler in roles.items():
            if isinstance(sampler, _DETERMINISTIC) or type(sampler) is BatchSampler:
                continue
            return _unseen(name, sampler)
        return None


def _unseen(name: str, sampler) -> str:
    """The warning for a sampler in role `name` whose random state the loader cannot see."""
    half = ""
    if hasattr(sampler, "set_epoch"):
        half = " It has set_epoch() but no `epoch` attribute: set self.epoch in set_epoch."
    return (
        f"loader.state_dict() cannot see the random state of the {name} "
        f"{type(sampler).__name__}: it holds no random generator as an attribute, has no "
        "set_epoch()/epoch and no state_dict()."
        + half
        + " If its order is random, a resume will not reproduce it. Give it a "
        "torch.Generator attribute, a (seed, epoch)-seeded order with set_epoch(), or "
        "state_dict()/load_state_dict() (see recipes.common.resume.loader_contract)."
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
    candidates = list(roles.values())
    if isinstance(dataset, IterableDataset):
        candidates = [dataset]
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
