"""What a loader state holds of a sampler: its random generators, its settings, and whether it
drew from a global random generator.

Use when: `StatefulLoader` captures the random state an epoch's order is drawn from, and
checks a loaded state against the loader it is loaded into (`loader_contract.py`).
Cost: a walk of at most three attribute levels per sampler, once per loader; a copy of each
generator's state (5 KB for a `torch.Generator`) once per epoch.
Adapt here: `_GENERATOR_KINDS` for another kind of random generator.
Trade-off: generators are found by walking attributes; one kept in a closure or a module
global is invisible (the global random generators are watched instead: `GlobalDraws`).
Copy with: common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

import base64
import inspect
import random
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import recipes.common.resume.state_keys as keys
from recipes.common.resume.state_records import KnownLength, saved_position

_DEPTH = 3


def find_generators(
    roots: Mapping[str, Any], unreproducible: list[str] | None = None
) -> dict[str, Any]:
    """The random generators reachable from `roots` through attributes, by dotted path
    (`{"sampler.generator": <torch.Generator>}`); each object is reported once. Generators
    that cannot be reproduced at all (`random.SystemRandom`: OS entropy) are listed in
    `unreproducible` instead."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj, path: str, depth: int) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, random.SystemRandom):
            if unreproducible is not None:
                unreproducible.append(path)
            return
        if _is_generator(obj):
            found[path] = obj
            return
        if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, torch.Tensor, np.ndarray)):
            return
        for name, value in sorted(getattr(obj, "__dict__", {}).items()):
            if isinstance(value, (list, tuple, dict, set)) or name in ("data_source", "dataset"):
                # never walk into data (a dataset can be big; its generators are the workers')
                continue
            walk(value, f"{path}.{name}", depth - 1)

    for name, root in roots.items():
        walk(root, name, _DEPTH)
    return found


def _is_generator(obj) -> bool:
    return isinstance(
        obj, (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
    )


def capture(generators: Mapping[str, Any]) -> dict[str, Any]:
    """Each generator's state as JSON."""
    return {path: _state_of(g) for path, g in generators.items()}


def restore(generators: Mapping[str, Any], states: Mapping[str, Any]) -> None:
    """Sets each generator to its saved state.

    Raises:
        ValueError: a saved generator this loader does not hold, or of another kind.
    """
    missing = sorted(set(states) - set(generators))
    if missing:
        raise ValueError(
            f"This loader state holds the random state of {missing}, which this loader does not "
            f"have (it has {sorted(generators) or 'no random generators'}); build the loader with "
            "the same sampler as the run that saved it."
        )
    for path, state in states.items():
        _set_state(generators[path], state, path)


def _state_of(g) -> dict[str, Any]:
    if isinstance(g, torch.Generator):
        return {
            "kind": "torch",
            "state": base64.b64encode(g.get_state().numpy().tobytes()).decode("ascii"),
        }
    if isinstance(g, np.random.Generator):
        return {"kind": "numpy", "state": _plain(g.bit_generator.state)}
    if isinstance(g, np.random.RandomState):
        name, keys, pos, has_gauss, gauss = g.get_state()
        return {
            "kind": "numpy-legacy",
            "state": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        }
    version, internal, gauss = g.getstate()
    return {"kind": "python", "state": [version, list(internal), gauss]}


def _set_state(g, saved: Mapping[str, Any], path: str) -> None:
    kind = {
        torch.Generator: "torch",
        np.random.Generator: "numpy",
        np.random.RandomState: "numpy-legacy",
    }.get(type(g), "python")
    if saved.get("kind") != kind:
        raise ValueError(
            f"This loader state holds a {saved.get('kind')} generator at {path}, but this loader "
            f"has a {kind} one there; build the loader with the same sampler as the run that saved "
            "it."
        )
    state = saved["state"]
    if kind == "torch":
        g.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
    elif kind == "numpy":
        g.bit_generator.state = _arrays(state)
    elif kind == "numpy-legacy":
        g.set_state((state[0], np.asarray(state[1], dtype=np.uint32), *state[2:]))
    else:
        g.setstate((state[0], tuple(state[1]), state[2]))


def _plain(value):
    """A bit generator's state as JSON: arrays (MT19937's key, Philox's counter) become
    `{"ndarray": dtype, "data": [...]}`."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.dtype.str, "data": value.tolist()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.integer):
        return int(value)
    return value


def _arrays(value):
    if isinstance(value, dict) and set(value) == {"ndarray", "data"}:
        return np.asarray(value["data"], dtype=np.dtype(value["ndarray"]))
    if isinstance(value, dict):
        return {k: _arrays(v) for k, v in value.items()}
    return value


class GlobalDraws:
    """Whether torch's, NumPy's or Python's global random generator was drawn from between
    `before()` and `after()` (a sampler's first draw of an epoch)."""

    def before(self) -> None:
        self._torch = torch.random.get_rng_state()
        state = np.random.get_state()
        self._numpy_keys = state[1]  # NumPy's legacy state: (name, keys, pos, ...)
        self._numpy_pos = state[2]
        self._python = random.getstate()

    def after(self) -> list[str]:
        drawn = []
        if not torch.equal(self._torch, torch.random.get_rng_state()):
            drawn.append("torch's")
        state = np.random.get_state()
        if state[2] != self._numpy_pos or not np.array_equal(state[1], self._numpy_keys):
            drawn.append("NumPy's")
        if random.getstate() != self._python:
            drawn.append("Python's")
        return drawn


def plan_settings(obj, *, batch_size: int | None = None) -> dict[str, Any] | None:
    """What of `obj` (a sampler, batch sampler or dataset) shapes the order and the batches,
    as JSON: its own `plan_settings()`, or what torch's samplers are built from."""
    own = getattr(obj, "plan_settings", None)
    if callable(own):
        return {"type": type(obj).__name__, **own()}
    if isinstance(obj, DistributedSampler):
        return {
            "type": "DistributedSampler",
            "num_samples": len(obj.dataset),
            "num_replicas": obj.num_replicas,
            "shuffle": obj.shuffle,
            "seed": obj.seed,
            "drop_last": obj.drop_last,
        }
    if isinstance(obj, RandomSampler):
        return {
            "type": "RandomSampler",
            "num_samples": obj.num_samples,
            "replacement": obj.replacement,
        }
    if isinstance(obj, SubsetRandomSampler):
        return {
            "type": "SubsetRandomSampler",
            "num_samples": len(obj),
            "indices": fingerprint(list(obj.indices)),
        }
    if isinstance(obj, WeightedRandomSampler):
        return {
            "type": "WeightedRandomSampler",
            "num_samples": obj.num_samples,
            "replacement": obj.replacement,
            "weights": fingerprint(obj.weights.numpy()),
        }
    if isinstance(obj, SequentialSampler):
        return {"type": "SequentialSampler", "num_samples": len(obj)}
    if isinstance(obj, BatchSampler):
        return {
            "type": "BatchSampler",
            "batch_size": obj.batch_size,
            "drop_last": obj.drop_last,
            "sampler": plan_settings(obj.sampler),
        }
    try:
        return {"type": type(obj).__name__, "length": len(obj)}
    except TypeError:
        return {"type": type(obj).__name__}


def fingerprint(values: Iterable | np.ndarray) -> str:
    """A short checksum of an array (lengths, shard sizes) for a plan's settings."""
    data = np.ascontiguousarray(np.asarray(values)).tobytes()
    return f"{zlib.crc32(data):08x}"


def differences(saved: Mapping[str, Any], mine: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`key: saved -> mine` for every setting that differs (nested dicts by dotted key)."""
    out = []
    for key in sorted(set(saved) | set(mine)):
        a = saved.get(key)
        b = mine.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} (saved) vs {b!r} (this loader)")
    return out


# ---- a sampler's own global position (elastic resumes) --------------------------------------
def positioned_sampler(batch_sampler):
    """What keeps the loader's global position over all ranks, so a resume may change their
    number: a `PositionedBatchSampler` (`state_dict` takes the loop's count, `batches_done=`),
    or torch's `BatchSampler` around a `PositionedSampler` (`samples_done=`); else None."""
    if _takes(batch_sampler, "batches_done"):
        return batch_sampler
    if isinstance(batch_sampler, BatchSampler) and _takes(batch_sampler.sampler, "samples_done"):
        return _SamplesPositioned(batch_sampler)
    return None


def _takes(obj, count: str) -> bool:
    if obj is None or not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        return False
    try:
        return count in inspect.signature(obj.state_dict).parameters
    except (TypeError, ValueError):
        return False


class _SamplesPositioned:
    """A `PositionedSampler` batched by torch's `BatchSampler`, counted in batches: the loop's
    `k` batches are `k x batch_size` samples (every batch mid-epoch is whole)."""

    def __init__(self, batch_sampler: BatchSampler):
        self.batches = batch_sampler
        self.sampler = batch_sampler.sampler

    def state_dict(self, *, batches_done: int | None = None) -> dict:
        return self.sampler.state_dict(samples_done=self._samples(batches_done))

    def _samples(self, batches_done: int | None) -> int | None:
        if batches_done is None:
            return None
        return batches_done * self.batches.batch_size

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def __len__(self) -> int:
        return len(self.batches)


def resumed_length(positioned, pending: dict, known: KnownLength | None) -> KnownLength:
    """The batches of an epoch that a positioned sampler resumes: those received before the
    resume and the sampler's rest (`len()` gives the rest only), or a whole epoch on this shape
    when that is more (on another number of ranks: a framework that takes the length once,
    Lightning, then counts from the step it restored and cuts neither this epoch nor the next;
    the epoch ends when its batches do). Loads `pending["sampler"]` into the sampler, as the
    pass does. `known`: the answer of an earlier call, kept for an equal state (the sampler
    holds the rest then, not a whole epoch). Returns the length with its state, to keep."""
    saved = pending[keys.SAMPLER]
    if known is not None and known.state == pending:
        positioned.load_state_dict(saved)
        return known
    try:
        whole = len(positioned)
        positioned.load_state_dict(saved)
        length = max(whole, saved_position(pending) + len(positioned))
    except TypeError:  # no length
        positioned.load_state_dict(saved)
        length = None
    return KnownLength(pending, length)
