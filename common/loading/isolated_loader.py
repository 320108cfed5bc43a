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
loop). Trade-off: needs the `fork` start method (Linux; elsewhere `make_loader` keeps the in-process
thread path). The batches are the same as `ThreadLoader`'s for the same seed, sampler and state
(each batch's draws come from `(seed, epoch, position)`), so a state saved on either path resumes on
the other. With `pin_memory` on CUDA, each batch is copied into pinned memory in the loop's process.
Copy with: common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/loader_path.py, common/loading/loop_probe.py,
  common/loading/stateful_loader.py, common/loading/thread_loader.py, common/resume/batch_seeds.py,
  common/resume/dataset_state.py, common/resume/elastic_rest.py, common/resume/loader_contract.py,
  common/resume/loader_counting.py, common/resume/loader_passes.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import recipes.common.loading.epoch_read_ahead as ahead
from recipes.common.loading.batch_ring import _TARGET, Ring, flatten, unflatten
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
        return None if self._child is None else self._child.process.pid

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
        for _ in range(
            REPLACEMENTS + 1
        ):  # a child stuck in its fork (start_watch.py) is forked again
            self.conn, child_end = context.Pipe(duplex=True)
            self.process = context.Process(
                target=_child_main,
                args=(loader, child_end, self.conn, watch.flags),
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
        try:
            self.conn.send(
                (
                    "read",
                    request,
                    slot,
                    indices,
                    epoch,
                    position,
                    self.loader.seed if seed is None else seed,
                    token,
                )
            )
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
            try:
                ready = self.conn.poll(_POLL_SECONDS)
                message = self.conn.recv() if ready else None
            except (EOFError, ConnectionResetError, OSError):
                raise self._died() from None
            if message is None:
                if not self.process.is_alive():
                    raise self._died()
                waited += time.monotonic() - start
                if self.loader.timeout is not None and waited >= self.loader.timeout:
                    raise IsolatedProcessHung(
                        f"IsolatedLoader: no batch from its child process (pid {self.process.pid}) "
                        f"within {self.loader.timeout:g} seconds (a hung read)"
                    )
                continue
            self._take(message)
        result = self._done.pop(request)
        if isinstance(result, BaseException):
            raise result
        return result

    def _take(self, message) -> None:
        kind = message[0]
        request = message[1]
        slot = self._slots.pop(request)
        if (
            kind in ("error", "failed", "changed") and request in self._dropped
        ):  # a batch nobody waits for
            self.ring.give_back(slot)
            self._dropped.discard(request)
            return
        if kind == "changed":  # a read ahead whose dataset changed under it: read anew in its epoch
            self.ring.give_back(slot)
            self._done[request] = ahead.CHANGED
            return
        if kind == "error":
            self.ring.give_back(slot)
            self._done[request] = _rebuilt(message[2], message[3])
            return
        if kind == "failed":
            self.ring.give_back(slot)
            self._done[request] = IsolatedHandOverError(
                f"IsolatedLoader could not hand a batch over from its child process: {message[2]}. "
                "A batch crosses as tensors, numpy arrays, numbers and strings in tuples, lists "
                "and dicts (anything else must pickle); a slot needs shared memory. The batch is "
                "not counted as received: RobustLoader resumes there, on the in-process thread "
                "path if it fails again."
            )
            return
        _, _, new_segment, spec, layouts = message
        if new_segment:
            from multiprocessing.reduction import recv_handle

            try:
                self.ring.attach(slot, recv_handle(self.conn))
            except (EOFError, ConnectionResetError, OSError):  # the child died between the two
                self.ring.give_back(slot)
                raise self._died() from None
        batch = unflatten(spec, self.ring.read(slot, layouts))
        if request in self._dropped:
            self._dropped.discard(request)
            return
        self._done[request] = _pinned(batch) if self.loader.pin else batch

    def _died(self) -> IsolatedProcessDied:
        self.process.join(1.0)
        code = self.process.exitcode
        how = (
            "is still running but its pipe closed"
            if code is None
            else (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        )
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
            self.conn.send(("stop",))
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        self.process.join(2.0 if wait else 0.25)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2.0 if wait else 0.25)
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


def _child_main(loader: IsolatedLoader, conn, parent_end, started) -> None:
    """The child: reads each asked batch in a pool of `loader.threads`, writes it into its slot,
    answers with its layout; ends on "stop", or when the loop's process is gone."""
    started[0] = 1  # its first act (start_watch.py)
    from recipes.common.workers.process_lifetime import _exit_when_orphaned, lower_priority
    from recipes.common.workers.worker import (
        _single_threaded_libraries,
        keep_inherited_pages_shared,
    )

    keep_inherited_pages_shared()  # no collection copies the loop's process's pages into the child
    parent_end.close()
    # ends with the loop's process, whichever of its threads forked it (a prctl death signal is
    # tied to the forking thread: a loop that began its epoch in a short-lived thread would lose it)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    _single_threaded_libraries()  # OpenCV inline in each pool thread (its pool's locks were forked)
    loader.pin = False  # pinned in the loop's process, where CUDA is
    lower_priority(loader.niceness)  # before the pool: its threads inherit it
    send = threading.Lock()
    pool = ThreadPoolExecutor(loader.threads, thread_name_prefix="IsolatedLoader")

    def work(request: int, slot: int, indices, epoch: int, position: int, seed: int, token) -> None:
        from multiprocessing.reduction import ForkingPickler

        fd = reply = None
        _TARGET.slot = (
            loader._ring,
            slot,
            0,
        )  # read_batch may make its batch in the slot (slot_tensor)
        try:
            batch = ahead.read_if_unchanged(loader, token, indices, epoch, position, seed)
        except BaseException as caught:  # noqa: BLE001 - the dataset's error (SystemExit too) goes to the loop
            reply = ForkingPickler.dumps(
                ("error", request, _picklable(caught), traceback.format_exc())
            )
        else:
            reply = ForkingPickler.dumps(("changed", request)) if batch is ahead.CHANGED else None
        if reply is None:
            # the hand-over's own failure (no memory for a slot, a leaf that does not pickle): not
            # the dataset's
            try:
                spec, tensors = flatten(batch)
                layouts, fd = loader._ring.write(slot, tensors)
                reply = ForkingPickler.dumps(("batch", request, fd is not None, spec, layouts))
            except Exception as caught:  # noqa: BLE001
                if fd is not None:
                    os.close(fd)
                fd = None
                reply = ForkingPickler.dumps(
                    ("failed", request, f"{type(caught).__name__}: {caught}")
                )
        _TARGET.slot = None
        with send:
            conn.send_bytes(reply)
            if fd is not None:
                from multiprocessing.reduction import send_handle

                send_handle(conn, fd, os.getppid())
                os.close(fd)

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "stop":
                break
            pool.submit(work, *message[1:])
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        os._exit(0)  # no atexit handlers of the parent's copy


def _picklable(error: BaseException) -> BaseException | None:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return None
