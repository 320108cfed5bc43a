"""Shards in open formats: `write_shards`, `ShardSet` and `index_shards`, the tar and Parquet
formats, their checks, and `ShardedIterableDataset`.

May import: `sampling`, `remote`, `caches`, `workers`, `resume`, `loader_warning`.
"""
