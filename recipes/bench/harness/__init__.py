"""The benchmarks' shared harness: timing and measuring loaders (`measure.py`), the peers'
loaders set up side by side (`peers.py`), each table as a chart for `--plot` (`bench_charts.py`),
and `recipes bench train`'s runner (`train.py`) with what each domain hands it
(`train_setup.py`). The tables themselves live one module each in `recipes/bench/`."""
