"""Sampling: exact sharding of indices over ranks, `LengthBucketSampler`, and mixtures
(`MixtureSampler`, `MixtureIterable`).

May import: `resume`, `loader_warning`.
"""
