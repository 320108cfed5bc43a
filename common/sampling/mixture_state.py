"""A `MixtureSampler`'s saved state: its keys named once, written and read back checked.

Use when: a mixture's state is saved or resumed (`MixtureSampler.state_dict()` /
`load_state_dict()`), or read by hand (a checkpoint migration, a test).
Cost: one comparison of the plan's settings (a small dict) on resume.
Adapt here: a new key is named here first.
Trade-off: the state holds the epoch and the plan's positions done over all ranks (O(1), never
O(samples)) with the settings that shape the plan: a resume regenerates the plan and refuses a
state saved under other settings, instead of saving the plan itself.
Copy with: nothing.
"""

from __future__ import annotations

from typing import NamedTuple

# The keys of `MixtureSampler.state_dict()`.
EPOCH = "epoch"
SAMPLES_DONE = "samples_done"  # index mode: positions of the plan done over all ranks
GLOBAL_BATCHES_DONE = "global_batches_done"  # batch mode: global batches done over all ranks
PLAN = "plan"  # `MixtureSampler.plan_settings()`: checked on resume
# In the plan of states saved before the index mode resumed elastically (ignored).
OLD_NUM_REPLICAS = "num_replicas"


class MixturePosition(NamedTuple):
    """Where a mixture stands: its epoch, and the plan's positions done over all ranks
    (samples in index mode, global batches in batch mode)."""

    epoch: int
    done: int


def done_key(batch_mode: bool) -> str:
    """The key of the positions done: global batches for a batch sampler, else samples."""
    if batch_mode:
        return GLOBAL_BATCHES_DONE
    return SAMPLES_DONE


def write_state(position: MixturePosition, settings: dict, *, batch_mode: bool) -> dict:
    """The JSON-able state of `position` under the plan's `settings`."""
    return {EPOCH: position.epoch, done_key(batch_mode): position.done, PLAN: settings}


def read_state(state: dict, settings: dict, *, batch_mode: bool) -> MixturePosition:
    """The position a state saved, checked against this sampler's plan `settings`.

    Raises:
        ValueError: a state saved under other sources, weights or settings.
    """
    saved = dict(state.get(PLAN) or {})
    saved.pop(OLD_NUM_REPLICAS, None)
    differ = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if differ:
        raise ValueError(
            "This MixtureSampler state was saved under other settings: "
            + ", ".join(f"{k}={saved.get(k)!r} (saved) vs {settings.get(k)!r}" for k in differ)
            + "; resume with the same sources, "
            "weights and settings (they decide the epoch's plan)."
        )
    return MixturePosition(int(state[EPOCH]), int(state.get(done_key(batch_mode), 0)))
