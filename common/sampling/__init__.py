"""Sampling: exact sharding of indices over ranks, `LengthBucketSampler`, and mixtures
(`MixtureSampler`, `MixtureIterable`; a mixture's weights, shared settings, epoch plan, saved
state and batch reads of its sources in the `mixture_*.py` modules beside them; how a
`MixtureIterable` consumer draws and resumes in `iterable_mixing/`).

May import: `resume`, `loader_warning`.
"""
