"""Sizing: the machine's resources, worker and memory sizing, loader profiles, and the store of
tuned settings.

May import: `workers`, `caches`.
"""
