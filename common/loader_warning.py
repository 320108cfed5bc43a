"""`LoaderWarning`: the one warning category of the loader layer.

Use when: filtering or escalating what the recipes warn about (a starved step, memory growth, a
dead worker, a sampler read ahead of training): `warnings.simplefilter("error", LoaderWarning)`.
Cost: none. Adapt here: nothing. Trade-off: one category for every loader warning; the
message says which and what to do.
Copy with: nothing.
"""


class LoaderWarning(UserWarning):
    """The loader is starving the step, too slow, growing, losing workers, or misused."""
