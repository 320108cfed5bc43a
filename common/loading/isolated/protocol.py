"""The messages between `IsolatedLoader` and its child process, as types.

Use when: reading or changing what crosses the pipe between the loop's process (the parent)
and the isolated loader's child: the parent asks with `Read` and ends with `Stop`; the child
answers each `Read` with exactly one of `Batch`, `Changed`, `Raised` or `Failed`, in the order
its pool finishes them (`request` ties an answer to its question).
Cost: one pickle per message (a `NamedTuple`: its class by reference, its fields by value; the
kind is the class's, never pickled): a `Read` or a `Batch` about 5.5 us to pickle and 3 us to
unpickle, a few hundred bytes (a 2.5 us pickle for the tuples they replaced), against the
milliseconds a batch takes to read.
Adapt here: a new message is a `Kind` member and a `NamedTuple` here, an answer in
`child.py`, and a row in the parent's table of replies (`isolated_loader.py`).
Trade-off: typed messages pickle their class's name (some 50 bytes a message) and go through
`__reduce_ex__` where a tuple of a short string would not: some 6 us more per batch (its `Read`
and its reply), for messages whose fields are read by name.

The child's life (`child.py`)::

    fork ──> STARTED ──(its start flag raised: start_watch.py)──> SERVING
                                                                   │  │
                     Read: a pool thread reads, writes the slot,   │  │ Stop, the pipe closed,
                     answers Batch | Changed | Raised | Failed  <──┘  │ or the parent gone
                                                                      v
                                                      EXITED (os._exit(0), no atexit)

A child that never reaches STARTED is killed and forked again (see NOTE [start watch]).
Copy with: nothing.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple


class Kind(enum.Enum):
    """What a message is; each message class names its own (`message.kind`)."""

    READ = "read"
    """Parent to child: read the batch of `indices` into ring slot `slot`."""
    STOP = "stop"
    """Parent to child: end now (the pool's queued reads are cancelled)."""
    BATCH = "batch"
    """Child to parent: the batch is in its slot; its structure and layout follow (and, for a
    new segment, the slot's file descriptor right after)."""
    CHANGED = "changed"
    """Child to parent: a read ahead whose dataset changed under it; the parent reads it anew
    in its epoch (`epoch_read_ahead.CHANGED`)."""
    RAISED = "raised"
    """Child to parent: the dataset raised; its error (when it pickles) and its traceback."""
    FAILED = "failed"
    """Child to parent: the batch was made but could not be handed over (no shared memory for
    the slot, a leaf that does not pickle): not the dataset's error."""


class Read(NamedTuple):
    """Read one batch (`epoch_read_ahead.read_if_unchanged`) and write it into `slot`."""

    request: int
    slot: int
    indices: Any
    epoch: int
    position: int
    seed: int
    token: Any  # a read ahead's key; None: no check
    kind = Kind.READ


class Stop(NamedTuple):
    """End the child."""

    kind = Kind.STOP


class Batch(NamedTuple):
    """The batch of `request` sits in its slot: `spec` (its structure, `batch_ring.flatten`),
    `layouts` (where each tensor lies); `new_segment`: a file descriptor follows the message."""

    request: int
    new_segment: bool
    spec: Any
    layouts: list
    kind = Kind.BATCH


class Changed(NamedTuple):
    """The read ahead of `request` found its dataset changed: read it anew."""

    request: int
    kind = Kind.CHANGED


class Raised(NamedTuple):
    """The dataset raised reading `request`: `error` (None when it does not pickle) and the
    child's traceback as `text`."""

    request: int
    error: BaseException | None
    text: str
    kind = Kind.RAISED


class Failed(NamedTuple):
    """The batch of `request` could not be handed over: `reason` ("TypeError: ...")."""

    request: int
    reason: str
    kind = Kind.FAILED
