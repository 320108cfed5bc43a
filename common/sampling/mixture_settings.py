"""The settings both mixtures share beside their weights, checked: the stop rules and counts.

Use when: a mixture (`MixtureSampler`, `MixtureIterable`) takes `stop=`, `num_samples=` or
`seed=`; the stop rules themselves are described in `mixture.py`'s docstring.
Cost: none (a few comparisons).
Adapt here: `STOPS` (a new rule is named here, then drawn in `mixture_plan.py` and
`iterable_mixing/mixture_draws.py`).
Trade-off: "all_exhausted" is refused rather than guessed: Hugging Face `datasets` and recipes
0.1 meant different rules by it.
Copy with: nothing.
"""

from __future__ import annotations

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
