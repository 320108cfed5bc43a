"""A `MixtureSampler`'s saved state: its keys named once, written and read back checked.

Use when: a mixture's state is saved or resumed (`MixtureSampler.state_dict()` /
`load_state_dict()`), or read by hand (a checkpoint migration, a test).
Cost: one comparison of the plan's settings (a small dict) on resume.
Adapt here: a new key is named here first.
Trade-off: the state holds the epoch and the plan's positions done over all ranks (O(1), never
O(samples)) with the settings that shape the plan: a resume regenerates the plan and refuses a
state saved under other settings, instead of saving the plan itself.
Copy with: common/sampling/mixture_plan.py, common/sampling/mixture_weights.py,
  common/sampling/pacing/mixture_pacing.py, common/sampling/pacing/mixture_schedule.py.
"""

from __future__ import annotations

from typing import NamedTuple

from recipes.common.sampling.pacing.mixture_pacing import Segment

# The keys of `MixtureSampler.state_dict()`.
EPOCH = "epoch"
SAMPLES_DONE = "samples_done"  # index mode: positions of the plan done over all ranks
GLOBAL_BATCHES_DONE = "global_batches_done"  # batch mode: global batches done over all ranks
PLAN = "plan"  # `MixtureSampler.plan_settings()`: checked on resume
# The segments a paced epoch (a schedule, lengths, or weights set by the loop) is drawn in, from
# the one holding the position on: each `Segment` as a dict of its fields. Absent for an
# epoch drawn i.i.d. from its start (fixed weights in samples, no change).
SEGMENTS = "segments"
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


def write_state(
    position: MixturePosition,
    settings: dict,
    *,
    batch_mode: bool,
    segments: list[Segment] | None = None,
) -> dict:
    """The JSON-able state of `position` under the plan's `settings` (and the segments its
    epoch's rest is drawn in, when paced)."""
    state = {EPOCH: position.epoch, done_key(batch_mode): position.done, PLAN: settings}
    if segments:
        state[SEGMENTS] = [segment._asdict() for segment in segments]
    return state


def read_segments(state: dict, sources: int) -> list[Segment] | None:
    """The segments a state saved, or None (an epoch drawn i.i.d. from its start).

    Raises:
        ValueError: segments of another number of sources, or out of order.
    """
    saved = state.get(SEGMENTS)
    if not saved:
        return None
    segments = []
    for entry in saved:
        weights = entry.get("weights")
        if weights is not None:
            weights = tuple(float(w) for w in weights)
        cursors = tuple(int(c) for c in entry["cursors"])
        segment = Segment(
            int(entry["start"]), int(entry["progress"]), cursors, weights, int(entry["number"])
        )
        if len(cursors) != sources or (weights is not None and len(weights) != sources):
            raise ValueError(
                f"This MixtureSampler state's segments are for {len(cursors)} sources; this "
                f"sampler has {sources}. Resume with the same sources."
            )
        if segments and segment.start < segments[-1].start:
            raise ValueError("This MixtureSampler state's segments are out of order (damaged).")
        segments.append(segment)
    return segments


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
