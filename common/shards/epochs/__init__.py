"""The epoch of a `ShardedIterableDataset`: who reads which pieces of which shards
(`shard_plan.py`), the order samples mix in (`shard_mixing.py`), how a consumer reads them
(`shard_reading.py`), one rank's reads put together (`rank_epoch.py`), the settings a loader
state checks (`plan_settings.py`), and the resume of an interrupted epoch (`epoch_resume.py`),
with the rest an elastic resume deals over new ranks (`shard_reshape.py`).

May import: `recipes.common.sampling`, `recipes.common.caches`.
"""
