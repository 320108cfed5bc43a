"""The keys of a loader's state dict, named once: what `StatefulLoader.state_dict()` (and the
thread and isolated loaders, which keep the same layout) writes and `load_state_dict()` reads.

Use when: you read or write a loader state by hand (a checkpoint migration, a test), or add a
field to it: name the key here and raise `STATE_VERSION` when a field's meaning changes.
Cost: none (constants).
Adapt here: nothing; a new key is added here first.
Trade-off: a state is plain JSON (no pickle), so its keys are strings; these names keep the
writer and the reader from drifting apart, as torchdata's `nodes/header.py` does for its nodes.
Copy with: nothing.
"""

from __future__ import annotations

# The layout's version, checked where a state is read (`StatefulLoader.load_state_dict`):
# 1 had no "plan"; 2 is the current one.
STATE_VERSION = 2

# Where the loop stands.
VERSION = "version"
EPOCH = "epoch"
BATCHES_YIELDED = "batches_yielded"
FINISHED_EPOCH = "finished_epoch"
POSITION = "position"  # an epoch position differing from BATCHES_YIELDED (a positioned resume)
NUM_WORKERS = "num_workers"

# How the epoch's order was drawn.
ORDER = "order"  # {"generators": ..., "samplers": ...} captured at the draw
GENERATORS = "generators"
SAMPLERS = "samplers"
SAMPLER = "sampler"  # a positioned sampler's own state
PLAN = "plan"  # batch size, drop_last and the sampler's length: checked on resume
BATCH_SEED = "batch_seed"
THREAD_SEED = "thread_seed"

# An iterable dataset's ranks, and an elastic resume's replay of other ranks' rests.
WORLD_SIZE = "world_size"
NODES = "nodes"
RESHAPED = "reshaped"
REPLAY_WORLD = "replay_world"
REPLAYED = "replayed"

# Datasets that keep their own state, per worker.
DATASET_STATES = "dataset_states"
DATASET_WORKERS = "dataset_workers"
NEXT_WORKER = "next_worker"
MAIN = "main"  # the key of this process's copy in DATASET_STATES, without workers

# A dataset copy's state (`dataset_state.copy_state`), as torchdata keeps it.
COPY_DATASET = "dataset"  # the dataset's own state_dict()
COPY_ITERATOR = "iterator"  # its iterator's
COPY_ENDED = "ended"  # its stream had ended
COPY_OWN_ITERATOR = "own_iterator"  # the dataset is its own iterator
