"""Tuning and watching: `autotune` (one trial in `tune_trial`, the choice and its reason in
`tune_choice`), `LoaderMonitor` (an epoch's figures in `monitor_epoch`, its warnings as a table of
rules in `monitor_rules`, its timeline plot in `monitor_plot`), the resource probes, and profiler
traces.

May import: `loading`, `sizing`, `remote`, `caches`, `workers`, `loader_warning`.
"""
