"""The benchmarks' shared harness: timing and measuring loaders (`measure.py`), the peers'
loaders set up side by side (`peers.py`), each table as a chart for `--plot` (`bench_charts.py`),
the worker count every table shares (`workers.py`), and `recipes bench train`'s runner
(`train.py`) with what each domain hands it (`train_setup.py`). The tables themselves live one
command module each in `recipes/bench/`, their pieces in its rooms (`images/`, `storage/`).

May import: `recipes.common` and itself; peers (LitData) and matplotlib only inside the function
that uses them. `train.py` imports each domain's `train_setup` module by name when it runs.
"""
