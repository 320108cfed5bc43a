"""Benchmarks of our loaders inside the training frameworks' loops: Lightning's `Trainer`
(`lightning_loop.py`, `recipes bench lightning`) and Hugging Face Accelerate's loop and the
transformers `Trainer` (`hf_loops.py`, `recipes bench hf`): time to the first batch after a
resume against the frameworks' skip-by-iterating, and samples/s against our plain loop.
Each imports its framework only when run."""
