"""The pieces of `recipes bench vision` (the command itself: `recipes/bench/vision.py`): the
built-in image folders (`data.py`), the eval rows (`eval_rows.py`), the warm path's per-image
costs (`warm_costs.py`), the train rows (`train_rows.py`) and what the vision domain hands
`recipes bench train` (`train_setup.py`).

May import: `recipes.common`, `recipes.vision`, `recipes.testing`, `recipes.testing_photos` and
`recipes.bench.harness`; peers (LitData) only inside the function that measures them.
"""
