"""The loader: `make_loader` and the path it chooses, `StatefulLoader`, `ThreadLoader`,
`IsolatedLoader` (its batch ring, its probe of the loop), `RobustLoader`, and the loader of a cache
build.

May import: `resume`, `sizing`, `sampling`, `caches`, `workers`, `loader_warning`.
"""
