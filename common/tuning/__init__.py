"""Tuning and watching: `autotune` and its probes, `LoaderMonitor`, and profiler traces.

May import: `loading`, `sizing`, `remote`, `caches`, `workers`, `loader_warning`.
"""
