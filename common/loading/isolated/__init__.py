"""The isolated loader's child process and the protocol it speaks: `protocol.py` (the message
kinds and typed messages, with the child's state diagram) and `child.py` (what the forked child
runs). The parent side, `IsolatedLoader` with its end of the pipe, stays at
`recipes.common.loading.isolated_loader`, where the library and its users import it.

May import: `loading.batch_ring`, `loading.epoch_read_ahead`, `workers`, `loader_warning`.
"""
