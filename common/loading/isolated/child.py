"""The isolated loader's child process: reads the batches the parent asks for, in a pool of
threads with a GIL of its own, and hands each over through its shared-memory slot.

Use when: reading what runs after `IsolatedLoader` forks: `serve` is the child's whole life
(the state diagram is in `protocol.py`). It answers every `Read` with one message, from the
pool thread that made the batch, in the order the pool finishes them.
Cost: per batch, a copy of its tensors into the slot (none when `read_batch` made them there,
`batch_ring.slot_tensor`) and one pickled reply of a few hundred bytes; a descriptor passed
over the pipe only when a slot grows.
Adapt here: what the child sets up before its pool starts (`_prepare`); the pool's size is the
loader's `threads`.
Trade-off: the child is a fork of the loop's process: it inherits the dataset and its caches
without pickling them, and with them whatever locks another thread held at the fork (which is
why the parent settles its reads and shuts its own pool before forking).
Copy with: common/loading/batch_ring.py, common/loading/epoch_read_ahead.py,
  common/loading/isolated/protocol.py, common/workers/process_lifetime.py, common/workers/worker.py.
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler, send_handle

import recipes.common.loading.epoch_read_ahead as ahead
from recipes.common.loading.batch_ring import _TARGET, Ring, flatten
from recipes.common.loading.isolated.protocol import (
    Batch,
    Changed,
    Failed,
    Kind,
    Raised,
    Read,
)
from recipes.common.workers.process_lifetime import exit_when_orphaned, lower_priority
from recipes.common.workers.worker import (
    keep_inherited_pages_shared,
    single_threaded_libraries,
)


def serve(loader, ring: Ring, conn, parent_end, started) -> None:
    """The child's life: reads each asked batch in a pool of `loader.threads`, writes it into
    its slot of `ring`, answers with its layout; ends on `Stop`, or when the loop's process is
    gone. `loader` is the child's copy of the `IsolatedLoader` (it reads batches, as a
    `ThreadLoader` does)."""
    # See NOTE [start watch]: raising its flag is its first act.
    started[0] = 1
    _prepare(loader, parent_end)
    replies = _Replies(loader, ring, conn)
    pool = ThreadPoolExecutor(loader.threads, thread_name_prefix="IsolatedLoader")
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message.kind is Kind.STOP:
                break
            pool.submit(replies.answer, message)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        os._exit(0)  # no atexit handlers of the parent's copy


def _prepare(loader, parent_end) -> None:
    """What the child sets up before its pool starts."""
    keep_inherited_pages_shared()  # no collection copies the loop's process's pages into the child
    parent_end.close()
    # ends with the loop's process, whichever of its threads forked it (a prctl death signal is
    # tied to the forking thread: a loop that began its epoch in a short-lived thread would lose it)
    threading.Thread(target=exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    single_threaded_libraries()  # OpenCV inline in each pool thread (its pool's locks were forked)
    loader.pin = False  # pinned in the loop's process, where CUDA is
    lower_priority(loader.niceness)  # before the pool: its threads inherit it


class _Replies:
    """Each `Read`'s answer, made and sent from the pool thread that read the batch."""

    def __init__(self, loader, ring: Ring, conn):
        self.loader = loader
        self.ring = ring
        self.conn = conn
        self._send = threading.Lock()  # one reply (and its descriptor) at a time on the pipe

    def answer(self, read: Read) -> None:
        # read_batch may make its batch in the slot (batch_ring.slot_tensor)
        _TARGET.slot = (self.ring, read.slot, 0)
        try:
            batch = ahead.read_if_unchanged(
                self.loader, read.token, read.indices, read.epoch, read.position, read.seed
            )
        except BaseException as caught:  # noqa: BLE001 - the dataset's error (SystemExit too) goes to the loop
            reply = Raised(read.request, _picklable(caught), traceback.format_exc())
            self._send_reply(ForkingPickler.dumps(reply), None)
            return
        finally:
            _TARGET.slot = None
        if batch is ahead.CHANGED:
            self._send_reply(ForkingPickler.dumps(Changed(read.request)), None)
            return
        self._hand_over(read, batch)

    def _hand_over(self, read: Read, batch) -> None:
        """`batch` into its slot; the hand-over's own failure (no memory for a slot, a leaf that
        does not pickle) is not the dataset's."""
        fd = None
        try:
            spec, tensors = flatten(batch)
            layouts, fd = self.ring.write(read.slot, tensors)
            reply = ForkingPickler.dumps(Batch(read.request, fd is not None, spec, layouts))
        except Exception as caught:  # noqa: BLE001
            if fd is not None:
                os.close(fd)
            fd = None
            reply = ForkingPickler.dumps(Failed(read.request, f"{type(caught).__name__}: {caught}"))
        self._send_reply(reply, fd)

    def _send_reply(self, reply: bytes, fd: int | None) -> None:
        """One reply, then the new segment's descriptor when there is one (closed here after)."""
        with self._send:
            self.conn.send_bytes(reply)
            if fd is not None:
                send_handle(self.conn, fd, os.getppid())
                os.close(fd)


def _picklable(error: BaseException) -> BaseException | None:
    """`error` when it crosses the pipe intact, else None (the parent rebuilds a RuntimeError
    from the traceback)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return None
