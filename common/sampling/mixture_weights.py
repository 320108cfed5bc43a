"""A mixture's sources and their weights: checked, named and normalised.

Use when: a mixture (`MixtureSampler`, `MixtureIterable`) takes its sources and their weights,
as two sequences or two mappings by source name; a new way to weigh sources (a schedule over
the epochs) starts here.
Cost: one pass over the weights (a handful of floats).
Adapt here: `parse_sources` (what a source may be named by, which weights are refused).
Trade-off: weights are normalised once, so only their ratios matter; a weight of 0 keeps a
source in the mixture's names and counts without ever drawing it.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np


class WeightedSources(NamedTuple):
    """The sources of a mixture, in their order, with their weights."""

    names: list[str]
    """Each source's name: its key in a mapping, else its position as a string."""
    values: list
    """What was given per source (a size, a dataset)."""
    weights: np.ndarray
    """float64, one per source, summing to 1."""


def parse_sources(values, weights, what: str) -> WeightedSources:
    """The sources from two sequences, or two mappings by source name.

    Raises:
        ValueError: mismatched shapes or names; negative, non-finite or all-zero weights.
    """
    if isinstance(values, Mapping):
        if not isinstance(weights, Mapping) or set(weights) != set(values):
            raise ValueError(
                f"`weights` must name the same sources as `{what}` ({sorted(values)}), but names "
                f"{_described(weights)}."
            )
        names = [str(k) for k in values]
        weights = [weights[k] for k in values]
        values = list(values.values())
    elif isinstance(weights, Mapping):
        raise ValueError(
            f"`weights` is a mapping but `{what}` is not: give both as mappings from source name, "
            "or both as sequences."
        )
    else:
        names = [str(i) for i in range(len(values))]
        values = list(values)
    return WeightedSources(names, values, _normalised(weights, len(values), what))


def even_weights(values) -> list[float] | dict:
    """Weights of 1 in the shape of `values` (a mapping by name, or a sequence): stand-ins where
    the weights come from elsewhere (a schedule)."""
    if isinstance(values, Mapping):
        return dict.fromkeys(values, 1.0)
    return [1.0] * len(values)


def _described(weights) -> str:
    """The names a mapping of weights gives, or the type of what was given instead."""
    if isinstance(weights, Mapping):
        return str(sorted(weights))
    return type(weights).__name__


def _normalised(weights, count: int, what: str) -> np.ndarray:
    """`weights` as float64 summing to 1, one per source, checked."""
    array = np.asarray(weights, dtype=np.float64)
    if not count or array.shape != (count,):
        raise ValueError(
            f"`{what}` and `weights` need one value per source, but have {count} and {array.size}."
        )
    if not np.isfinite(array).all() or (array < 0).any() or array.sum() <= 0:
        raise ValueError(
            "`weights` must be non-negative and finite with a positive sum, but are "
            f"{array.tolist()}."
        )
    if not np.isfinite(array.sum()):
        raise ValueError(
            f"`weights` sum to infinity in float64 (they are {array.tolist()}): only their ratios "
            "matter, so scale them down (divide by the largest)."
        )
    return array / array.sum()
