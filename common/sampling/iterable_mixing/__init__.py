"""How a `MixtureIterable` (`sampling/mixture_iterable.py`) consumer interleaves its sources
(`mixture_draws.py`: drawn at random, or paced to shares of samples or tokens), and how an
interrupted epoch goes on, on the same or another shape (`mixture_rest.py`).

May import: `recipes.common.sampling`.
"""
