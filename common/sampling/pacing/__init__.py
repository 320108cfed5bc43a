"""How a `MixtureSampler`'s weights move during training: a `Schedule` over progress in samples
or tokens (`mixture_schedule.py`), the paced draw that holds those shares at every position
(`mixture_pacing.py`), an epoch's plan in segments cut by the loop's changes
(`mixture_epoch.py`), and a change agreed over the ranks (`mixture_changes.py`).

May import: `recipes.common.sampling`.
"""
