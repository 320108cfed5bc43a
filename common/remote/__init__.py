"""Remote objects: `PrefetchCache`, ranged and whole-object downloads, and retries.

May import: `workers`, `caches`.
"""
