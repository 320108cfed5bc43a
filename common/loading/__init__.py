"""The loader: `make_loader` and its rules as tables (the path, the sampler, the worker processes'
safety), `StatefulLoader`, `ThreadLoader`, `IsolatedLoader` (its batch ring, its probe of the loop),
`RobustLoader`, and the loader of a cache build.

May import: `resume`, `sizing`, `sampling`, `caches`, `workers`, `loader_warning`.
"""
