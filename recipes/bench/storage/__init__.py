"""The pieces of `recipes bench shards` (the command itself: `recipes/bench/shards.py`):
writing an image folder as shards ours and the peers' way (`writes.py`), reading them back over
a throttled remote store and from local disk (`reads.py`), and the class mix of the batches
read back (`quality.py`).

May import: `recipes.common`, `recipes.commands.shards_cmd`, `recipes.testing_servers` and
`recipes.bench.harness`; the peers (webdataset, LitData) only inside the function that measures
them.
"""
