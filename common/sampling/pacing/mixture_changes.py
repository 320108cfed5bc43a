"""A change of a mixture's weights by the training loop: checked, and agreed over the ranks.

Use when: a training loop calls `MixtureSampler.set_weights(weights)` between steps (weights
from a loss per source, DoReMi-style): every rank must pass the same weights at the same step,
and the change must take effect at one global position that no rank has drawn yet.
Cost: one `all_gather_object` of two numbers per rank per change (when `torch.distributed` is
initialised with the sampler's ranks); none otherwise.
Adapt here: `agree` (what the ranks compare).
Trade-off: the change takes effect at the next global position that no rank has drawn (the
loader reads ahead), so where a change lands depends on how far the loader read ahead; the
position is recorded in the sampler's state, so a resume replays the same draws exactly. The
checksum catches ranks that pass different weights; it cannot catch a rank that does not call
`set_weights` at all (the collective then waits for it, as any collective does).
Copy with: common/sampling/mixture_weights.py.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import numpy as np
import torch

from recipes.common.sampling.mixture_weights import parse_sources


class Agreed(NamedTuple):
    """A change every rank agreed on."""

    weights: tuple[float, ...]
    """The new weights, normalised, in the sources' order."""
    position: int
    """The global position (samples, or global batches) where the change takes effect."""


def parsed_change(names: list[str], weights) -> tuple[float, ...]:
    """`weights` (a mapping by source name, or a sequence in the sources' order) normalised.

    Raises:
        ValueError: an unknown or missing source, negative or non-finite weights, or weights
            without a positive sum.
    """
    if isinstance(weights, dict) or hasattr(weights, "keys"):
        values = dict.fromkeys(names, 0)
        unknown = sorted(str(k) for k in weights if str(k) not in names)
        if unknown:
            raise ValueError(
                f"`set_weights` names unknown source(s) {unknown}; the mixture's sources are "
                f"{names}."
            )
        weights = {str(k): v for k, v in weights.items()}
    else:
        values = list(range(len(names)))
    return tuple(parse_sources(values, weights, "the mixture's sources").weights.tolist())


def agree(weights: tuple[float, ...], position: int, num_replicas: int) -> Agreed:
    """The change every rank makes: the ranks' weights compared by checksum, and the furthest
    position any rank has drawn (`position`: this rank's, in global units).

    Raises:
        ValueError: on every rank, when some ranks passed other weights than rank 0 (named).
    """
    if not _collective(num_replicas):
        return Agreed(weights, int(position))
    checksum = zlib.crc32(np.asarray(weights, np.float64).tobytes())
    gathered: list = [None] * num_replicas
    torch.distributed.all_gather_object(gathered, (checksum, int(position)))
    sums = [int(g[0]) for g in gathered]
    other = [rank for rank, value in enumerate(sums) if value != sums[0]]
    if other:
        raise ValueError(
            f"`set_weights` was given other weights on rank(s) {other} than on rank 0 (checksums "
            f"{[f'{s:08x}' for s in sums]}): every rank must pass the same weights at the same "
            "step, or the ranks' plans would diverge. Compute them on one rank and broadcast "
            "them, or reduce the per-source losses over the ranks first."
        )
    return Agreed(weights, max(int(g[1]) for g in gathered))


def held_error(holder: str) -> ValueError:
    """The error of `set_weights` on a mixture a bucketing or packing sampler reads whole."""
    return ValueError(
        f"This MixtureSampler's plan is bucketed by a {holder}(mixture=), which reads each "
        "epoch's plan whole and saves no changes in its state: `set_weights` is not supported "
        "there (a change would miss the current epoch and be lost on resume). Use a `Schedule`, "
        "or the MixtureSampler as the loader's sampler."
    )


def check_holdable(draws, holder: str) -> None:
    """Refuses to hand a plan (`draws`, an `EpochDraws`) to `holder` once the loop set weights.

    Raises:
        ValueError: weights the loop already set (the holder's state would not keep them).
    """
    if draws.epoch >= 0 and any(s.weights is not None for s in draws.segments):
        raise ValueError(
            f"{holder}(mixture=) got a MixtureSampler whose weights the loop set "
            "(`set_weights`): its state would not keep them. Build the mixture with the "
            "weights (or a `Schedule`) instead."
        )


def _collective(num_replicas: int) -> bool:
    """Whether the sampler's ranks are `torch.distributed`'s (else each rank decides alone)."""
    if num_replicas <= 1:
        return False
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return torch.distributed.get_world_size() == num_replicas
