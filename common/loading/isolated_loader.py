"""IsolatedLoader: the thread path run in a child process, beside a training loop that needs the
GIL.

Use when: a `ThreadLoader`'s dataset (a memory-speed cache, OpenCV decoding) feeds a training
step that holds the GIL for part of each step (an eager PyTorch step launches its kernels and
steps its optimizer in Python). In one process the loop's thread and the pool's threads take
turns at the GIL, and both slow down; here the pool runs in a child with its own GIL, and the
loop's process only maps finished batches.
Cost: one fork, kept over the epochs while the dataset's attributes stay as they were
(`dataset_fingerprint`: a new resolution, a cache attached or replaced forks a new child at
the next epoch); per batch a copy into a shared-memory slot in the child and a few hundred
bytes of layout through a pipe (`batch_ring.py`). No pickling of the batch, no new segment per
batch.
Adapt here: `threads`, `prefetch` (as `ThreadLoader`'s), `timeout`, `niceness` (the child below the
loop). This module is the parent's side; the child's is `isolated/child.py`, and the messages
between them are typed in `isolated/protocol.py` (with the child's life as a state diagram).
Trade-off: needs the `fork` start method (Linux; elsewhere `make_loader` keeps the in-process
thread path). The batches are the same as `ThreadLoader`'s for the same seed, sampler and state
(each batch's draws come from `(seed, epoch, position)`), so a state saved on either path resumes on
the other. With `pin_memory` on CUDA, each batch is copied into pinned memory in the loop's process.
Copy with: common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated/child.py,
  common/loading/isolated/protocol.py, common/loading/loader_path.py, common/loading/loop_probe.py,
  common/loading/stateful_loader.py, common/loading/thread_loader.py, common/resume/batch_seeds.py,
  common/resume/dataset_state.py, common/resume/elastic_rest.py, common/resume/loader_contract.py,
  common/resume/loader_counting.py, common/resume/loader_passes.py, common/resume/loader_resume.py,
  common/resume/loader_state.py, common/resume/order_sources.py, common/resume/pass_sampler.py,
  common/resume/state_keys.py, common/resume/state_records.py, common/sizing/resources.py,
  common/sizing/sizing.py, common/workers/process_lifetime.py, common/workers/start_watch.py,
  common/workers/worker.py.
"""

from __future__ import annotations

import multiprocessing
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import recv_handle
from typing import Any

import recipes.common.loading.epoch_read_ahead as ahead
from recipes.common.loading.batch_ring import Ring, unflatten
from recipes.common.loading.isolated.child import serve
from recipes.common.loading.isolated.protocol import (
    Batch,
    Changed,
    Failed,
    Kind,
    Raised,
    Read,
    Stop,
)
from recipes.common.loading.loader_path import check_niceness, isolated_available
from recipes.common.loading.loop_probe import LoopProbe, TimedBatches
from recipes.common.loading.thread_loader import ThreadLoader, _pinned
from recipes.common.resume.loader_counting import Counting, LoaderClosedError
from recipes.common.workers.start_watch import REPLACEMENTS, StartWatch

_POLL_SECONDS = 0.5


class IsolatedProcessDied(RuntimeError):
    """The isolated loader's child process ended under the epoch (the OOM killer, a signal, a
    crash in native code); `RobustLoader` restarts it at the first batch the loop has not got."""

    batch_not_made = True  # the batch waited for is not behind the loop (thread_loader._Batches)


class IsolatedProcessHung(RuntimeError):
    """No batch from the child within the loader's `timeout`."""

    batch_not_made = True


class IsolatedHandOverError(RuntimeError):
    """The child made a batch but could not hand it over (no shared memory for its slot, a leaf
    that does not pickle): not the dataset's error, and the batch is not counted as received."""

    batch_not_made = True


class IsolatedLoader(ThreadLoader):
    """A `ThreadLoader` whose pool runs in a child process; same arguments, batches and state.

    Args:
        dataset, threads, prefetch, seed, **kwargs: as for `ThreadLoader`.
        timeout: seconds a batch may take before the child counts as hung (a `RuntimeError`
            naming it); None waits as long as the child lives.
        adaptive: measure the loop (`loop_probe.LoopProbe`): from the next epoch, threads of this
            process while the loop's thread spends under 10% of its time between batches on a CPU (a
            step that waits on the device, GIL released), the child again above 20%. `make_loader`
            sets it when it chose this path by itself.
        niceness: how far below the loop's process the child is scheduled (`os.nice`): where the
            step needs a core the child also wants, the step runs first and the child, whose
            batches wait in the prefetch, takes the rest (`recipes bench step`, a step holding
            the GIL 5 ms of 5.5 on 2 cores: 70-75% of the ideal at 0, 75-83% at 5). 0 schedules
            both alike.

    Raises:
        TypeError: as `ThreadLoader`.
        RuntimeError: without the `fork` start method.
    """

    def __init__(
        self,
        dataset,
        *,
        timeout: float | None = None,
        adaptive: bool = False,
        niceness: int = 5,
        **kwargs: Any,
    ):
        if not isolated_available():
            raise RuntimeError(
                "IsolatedLoader forks its child process, which this platform cannot; use "
                "make_loader(..., path='threads') for the thread path in this process."
            )
        if timeout is not None and timeout <= 0:
            raise ValueError(f"`timeout` must be positive, but is {timeout!r} instead.")
        check_niceness(niceness)
        super().__init__(dataset, **kwargs)
        self.timeout = timeout
        self._ring = Ring()
        self._child: _Child | None = None
        self.adaptive = adaptive
        self.niceness = niceness
        self._probe = LoopProbe()

    def _begin_pass(self):
        current = self._passes.start(0)
        if self.adaptive and self._probe.decide(self):
            # the loop's thread needs no GIL: threads of this process serve it faster
            self._stop_child()
            self._in_process_pool()
            return current, TimedBatches(self, iter(self._index_sampler), current)
        if isinstance(self._pool, ThreadPoolExecutor):
            # no thread of this process may be inside a read when the child is forked (a lock it
            # holds would be copied held): the batches asked of it (the last epoch's rest after a
            # break, the next epoch's made ahead) are cancelled, and a running one is waited for
            self._pool.shutdown(wait=True, cancel_futures=True)
        seen = ahead.dataset_fingerprint(self.dataset)
        child = self._child
        if child is None or not child.process.is_alive() or child.fingerprint != seen:
            # the dataset changed since the fork (a resolution, a cache attached)
            self._stop_child()
            self._child = _Child(self, seen)
        self._pool = self._child  # what _Batches submits to
        return current, TimedBatches(self, iter(self._index_sampler), current)

    @property
    def in_process(self) -> bool:
        """Whether the epoch's batches are made by threads of this process (the probe found a
        loop whose thread needs no GIL), not by the child's."""
        return isinstance(self._pool, ThreadPoolExecutor)

    def __iter__(self):
        return Counting(
            self._passes, *self._begin_pass(), restart=weakref.WeakMethod(self._begin_pass)
        )

    @property
    def child_pid(self) -> int | None:
        """The pid of the epoch's child process (None before the first `iter` and after `close`)."""
        if self._child is None:
            return None
        return self._child.process.pid

    @property
    def ring_slots(self) -> int:
        """Shared-memory batch slots made so far (prefetch + the batches the loop holds)."""
        return self._ring.slots

    def _retire_child(self, pending) -> None:
        """Moved to threads of this process mid-epoch: the child ends once the loop has every
        batch asked of it (none left in `pending`)."""
        if not any(isinstance(future, _Remote) for future in pending):
            self._stop_child()

    def _stop_child(self) -> None:
        child = self._child
        self._child = None
        if child is not None:
            child.stop()

    def close(self) -> None:
        """Ends the child process (or this process's pool); the next `iter` starts another. An
        epoch's iterator in use then raises `LoaderClosedError`; the state stays where it was."""
        super().close()  # the epoch's pool: the child (`_Child.shutdown`) or this process's threads
        self._stop_child()


class _Remote:
    """A batch asked of the child: `result()` waits for it (a `Future`'s part `_Batches` uses)."""

    def __init__(self, child: _Child, request: int):
        self._child = child
        self.request = request

    def result(self):
        return self._child.wait(self.request)

    def cancel(self) -> bool:
        self._child.cancelled(self.request)
        return True


class _Child:
    """One epoch's child process, with the pipe to it; `submit` asks for a batch."""

    def __init__(self, loader: IsolatedLoader, fingerprint: tuple):
        # a weak reference: a loader dropped without close() is freed at once, and ends its child
        self._loader = weakref.ref(loader)
        self.ring = loader._ring
        self.fingerprint = fingerprint
        context = multiprocessing.get_context("fork")
        watch = StartWatch(1)
        self._next_request = 0
        self._dropped = set()
        self._done: dict[int, Any] = {}
        self._slots: dict[int, int] = {}  # request -> slot
        # See NOTE [start watch]: a child stuck in its fork is forked again.
        for _ in range(REPLACEMENTS + 1):
            self.conn, child_end = context.Pipe(duplex=True)
            self.process = context.Process(
                target=serve,
                args=(loader, self.ring, child_end, self.conn, watch.flags),
                daemon=True,
                name="IsolatedLoader",
            )
            # no thread of this process inside a read (another loader's) at the fork
            ahead.settle_reads_ahead()
            self.process.start()
            # forked: the loader's copy is the child's; no reference kept here
            self.process._args = ()
            child_end.close()
            if watch.started(self.process):
                break
            self.conn.close()
        self._finalizer = weakref.finalize(loader, _Child.stop, self, False)

    def submit(
        self, fn, indices, epoch: int, position: int, seed: int | None = None, token=None
    ) -> _Remote:
        """`token`: a read ahead's key (`epoch_read_ahead.read_if_unchanged`, in the child)."""
        request = self._next_request
        slot = self.ring.take()
        self._next_request += 1
        self._slots[request] = slot
        if seed is None:
            seed = self.loader.seed
        read = Read(request, slot, indices, epoch, position, seed, token)
        try:
            self.conn.send(read)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the child is gone: wait() says so
        return _Remote(self, request)

    def cancelled(self, request: int) -> None:
        if request in self._done:
            self._done.pop(request)  # its batch is dropped here: the slot's views go with it
        else:
            self._dropped.add(request)

    @property
    def loader(self) -> IsolatedLoader:
        loader = self._loader()
        if loader is None:
            raise LoaderClosedError(
                "this IsolatedLoader was garbage-collected while its epoch was running."
            )
        return loader

    def wait(self, request: int):
        waited = 0.0
        while request not in self._done:
            start = time.monotonic()
            message = None
            try:
                if self.conn.poll(_POLL_SECONDS):
                    message = self.conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                raise self._died() from None
            if message is not None:
                self._take(message)
                continue
            if not self.process.is_alive():
                raise self._died()
            waited += time.monotonic() - start
            if self.loader.timeout is not None and waited >= self.loader.timeout:
                raise IsolatedProcessHung(
                    f"IsolatedLoader: no batch from its child process (pid {self.process.pid}) "
                    f"within {self.loader.timeout:g} seconds (a hung read)"
                )
        result = self._done.pop(request)
        if isinstance(result, BaseException):
            raise result
        return result

    def _take(self, message) -> None:
        """One reply of the child: its batch (or error) is done, or dropped if nobody waits."""
        slot = self._slots.pop(message.request)
        if message.kind is Kind.BATCH:
            self._take_batch(message, slot)
            return
        self.ring.give_back(slot)  # no batch in it
        if message.request in self._dropped:  # a batch nobody waits for
            self._dropped.discard(message.request)
            return
        self._done[message.request] = _OUTCOMES[message.kind](message)

    def _take_batch(self, message: Batch, slot: int) -> None:
        if message.new_segment:
            try:
                self.ring.attach(slot, recv_handle(self.conn))
            except (EOFError, ConnectionResetError, OSError):  # the child died between the two
                self.ring.give_back(slot)
                raise self._died() from None
        batch = unflatten(message.spec, self.ring.read(slot, message.layouts))
        if message.request in self._dropped:
            self._dropped.discard(message.request)
            return
        if self.loader.pin:
            batch = _pinned(batch)
        self._done[message.request] = batch

    def _died(self) -> IsolatedProcessDied:
        self.process.join(1.0)
        how = _how_it_ended(self.process.exitcode)
        return IsolatedProcessDied(
            f"IsolatedLoader's child process (pid {self.process.pid}) {how} under the "
            "epoch (the OOM killer, a signal, or a crash in native code). RobustLoader "
            "restarts it at the first batch the loop has not received; without it, "
            "load loader.state_dict() into a new loader to continue there."
        )

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        """`ThreadPoolExecutor.shutdown`'s part (ThreadLoader's close and finalizer): `stop`."""
        self.stop(wait)

    def stop(self, wait: bool = True) -> None:
        """Ends the child: asked to stop, then killed; `wait=False` (a finalizer) waits at most
        0.5 s in all, so that it is reaped rather than left a zombie."""
        self._finalizer.detach()
        if self.conn.closed:
            return
        try:
            self.conn.send(Stop())
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        patience = 0.25  # a finalizer's: at most 0.5 s in all
        if wait:
            patience = 2.0
        self.process.join(patience)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(patience)
        self.conn.close()
        for slot in self._slots.values():  # asked, never received: their slots are free again
            self.ring.give_back(slot)
        self._slots.clear()


def _rebuilt(error: BaseException | None, text: str) -> BaseException:
    """The dataset's error, with the child's traceback as a note (where in `read_batch`)."""
    if error is None:
        return RuntimeError(f"IsolatedLoader: the dataset raised in the child process:\n{text}")
    if hasattr(error, "add_note"):
        error.add_note(f"Raised in IsolatedLoader's child process:\n{text.rstrip()}")
    return error


def _how_it_ended(code: int | None) -> str:
    """The child's end, from its exit code, as the error says it."""
    if code is None:
        return "is still running but its pipe closed"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _failed(message: Failed) -> IsolatedHandOverError:
    return IsolatedHandOverError(
        f"IsolatedLoader could not hand a batch over from its child process: {message.reason}. "
        "A batch crosses as tensors, numpy arrays, numbers and strings in tuples, lists "
        "and dicts (anything else must pickle); a slot needs shared memory. The batch is "
        "not counted as received: RobustLoader resumes there, on the in-process thread "
        "path if it fails again."
    )


def _read_anew(message: Changed):
    """A read ahead whose dataset changed under it: read anew in its epoch."""
    return ahead.CHANGED


def _raised(message: Raised) -> BaseException:
    return _rebuilt(message.error, message.text)


# What a reply without a batch leaves for the loop to take, by its kind (`_Child._take`)
_OUTCOMES = {Kind.CHANGED: _read_anew, Kind.RAISED: _raised, Kind.FAILED: _failed}
