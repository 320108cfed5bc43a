"""Resume: the contract samplers and datasets implement, the loader's passes and state, per-batch
seeds, and datasets' own states.

May import: `loader_warning` only.
"""
