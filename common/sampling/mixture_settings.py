"""The settings both mixtures share beside their weights, checked: the stop rules and counts.

Use when: a mixture (`MixtureSampler`, `MixtureIterable`) takes `stop=`, `num_samples=` or
`seed=`, or a `MixtureSampler` its sources' `sizes` and samples' `lengths`; the stop rules
themselves are described in `mixture.py`'s docstring.
Cost: none (a few comparisons).
Adapt here: `STOPS` (a new rule is named here, then drawn in `mixture_plan.py` and
`iterable_mixing/mixture_draws.py`).
Trade-off: "all_exhausted" is refused rather than guessed: Hugging Face `datasets` and recipes
0.1 meant different rules by it.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

STOPS = ("drop_exhausted", "first_exhausted", "cycle_until_all_exhausted", "never")


def check_stop(stop: str, num_samples) -> None:
    """Refuses an unknown or ambiguous `stop`, and "never" without an epoch length."""
    if stop == "all_exhausted":
        raise ValueError(
            "stop='all_exhausted' is ambiguous: Hugging Face `datasets` cycles exhausted sources "
            "until all are seen whole (here 'cycle_until_all_exhausted': the proportions hold), "
            "and recipes 0.1 dropped them (here 'drop_exhausted', the default: every sample "
            "exactly once). Name the rule you want."
        )
    if stop not in STOPS:
        raise ValueError(f"`stop` must be one of {STOPS}, but is {stop!r} instead.")
    if stop == "never" and num_samples is None:
        raise ValueError(
            "stop='never' refills sources for ever: give `num_samples`, the epoch's length."
        )


def check_count(name: str, value, *, minimum: int = 1) -> int | None:
    """`value` as a plain int (numpy ints too: states are JSON), checked; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer of at least {minimum}, but is {value!r} instead."
        )
    return int(value)


def whole_sizes(sizes: list, names: list[str]) -> np.ndarray:
    """`sizes` as int64, each a positive whole number.

    Raises:
        ValueError: a fractional size, or a source without samples (named).
    """
    raw = np.asarray(sizes)
    whole_floats = raw.dtype.kind == "f" and np.all(raw == np.floor(raw))
    if raw.dtype.kind not in "iu" and not whole_floats:
        raise ValueError(f"`sizes` must be whole numbers of samples, but are {raw.tolist()}.")
    out = raw.astype(np.int64)
    if (out <= 0).any():
        raise ValueError(
            f"every source needs samples; sizes are {out.tolist()} (source "
            f"{names[int(np.argmin(out))]!r})."
        )
    return out


def source_lengths(lengths, sizes: np.ndarray, names: list[str]) -> list[np.ndarray] | None:
    """Per source, its samples' lengths (tokens) as int64, from a mapping by source name, a
    sequence of per-source arrays, or one array over all sources in order; None stays None.

    Raises:
        ValueError: a source's lengths of another count than its size, negative or fractional
            lengths, a source whose lengths are all 0, or a mapping naming other sources.
    """
    if lengths is None:
        return None
    if isinstance(lengths, Mapping):
        if set(map(str, lengths)) != set(names):
            raise ValueError(
                f"`lengths` must name the mixture's sources {names}, but names "
                f"{sorted(map(str, lengths))}."
            )
        named = {str(k): v for k, v in lengths.items()}
        parts = [named[name] for name in names]
    elif len(lengths) == len(sizes) and all(np.ndim(part) == 1 for part in lengths):
        parts = list(lengths)
    else:
        flat = np.asarray(lengths)
        if flat.ndim != 1 or len(flat) != int(sizes.sum()):
            raise ValueError(
                f"`lengths` must give every sample's length: one array per source, or one of "
                f"{int(sizes.sum())} entries over all sources in order, but has shape "
                f"{flat.shape}."
            )
        parts = np.split(flat, np.cumsum(sizes)[:-1])
    out = []
    for name, size, part in zip(names, sizes.tolist(), parts, strict=True):
        array = np.asarray(part)
        if array.shape != (size,):
            raise ValueError(
                f"`lengths` of source {name!r} has {array.size} entries, but the source holds "
                f"{size} samples."
            )
        if array.dtype.kind not in "iu" or (array < 0).any():
            raise ValueError(
                f"`lengths` of source {name!r} must be non-negative whole numbers of tokens."
            )
        if not array.any():
            raise ValueError(
                f"`lengths` of source {name!r} are all 0: a source of no tokens cannot hold a "
                "share of tokens (under a cycling stop rule its draws would never advance the "
                "progress). Leave it out of the mixture, or give its samples' lengths."
            )
        out.append(array.astype(np.int64))
    return out
