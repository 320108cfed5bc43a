"""Caches on disk: the cache-file protocol (atomic folders, versioned headers, fingerprints,
checksums), how a cache is built by several processes or ranks, cache folders, and `PackedStrings`.

May import: `workers`.
"""
