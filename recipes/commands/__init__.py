"""The commands of the `recipes` command line, one module each: `doctor`, `cache` (and its
`--verify`, `cache_verify.py`), `shards`, `template`, `tune`. `recipes/cli.py` imports a
command's module only when that command runs; `recipes bench` lives in `recipes/bench/`.

May import: `recipes.common` and the domains (`recipes.vision`, `recipes.nlp`, `recipes.audio`).
"""
