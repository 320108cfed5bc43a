"""StartWatch: a forked DataLoader worker that never starts is replaced, with no batch lost.

Use when: workers start by `fork` on Linux (`make_loader`'s default). `watched_iterator` is in
`StatefulLoader` (so `make_loader`, `RobustLoader`) and the cache builds' loader; the isolated
path's child uses `StartWatch.started`.
Cost: the iterator's creation waits until every worker has run its first line of Python
(milliseconds, mostly overlapped with the wait for the first batch); one page of shared memory.
Adapt here: `START_SECONDS` (how long a worker may take to start), `REPLACEMENTS`.
Trade-off: the start of an epoch blocks on the slowest worker's start, not on the first batch.

Why and how: NOTE [start watch] below.
Copy with: common/loader_warning.py.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import sys
import time
import warnings

from recipes.common.loader_warning import LoaderWarning

# NOTE [start watch]
# Why: on CPython before 3.12 (3.11.9, 3.10.14 and older) `os.fork()` can copy the interpreter's
# thread-state lock while another thread holds it, and the child waits on it forever before it
# runs any Python (CPython gh-112275). A thread that enters Python from C++ (torch.distributed's
# and Lightning's threads do) takes that lock without the GIL, so under DDP about one epoch start
# in a hundred left a worker stuck: the loop waited forever for its batches (DataLoader sees a
# live process), and `RobustLoader` only after its `timeout`. Measured here: 1 of 93 launches of
# a 2-rank Lightning run (`test_lightning_resume.py`), gdb showing the worker in
# `PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept`.
#
# How: each worker raises its flag in a shared page as the first act of its `worker_init_fn`.
# A worker silent after `START_SECONDS` is stopped (SIGSTOP), its flag read again (a slow worker
# is let go on), then killed and replaced by a new process with the same arguments: the same
# index queue (the indices already put in it), worker id and seed, so its batches are the ones
# the stuck worker would have made. It had not run any Python, so it held none of the queues'
# locks. The isolated loader's child raises flag 0 as its first act, and one silent for
# `START_SECONDS` is killed and forked again (`StartWatch.started`).

START_SECONDS = 15.0
REPLACEMENTS = 3  # per iterator; beyond them the workers are left as they are, with a warning
_WHY = "CPython gh-112275: a fork while another thread held the interpreter's lock, Python < 3.12"


class _Started:
    """The loader's `worker_init_fn`, after raising worker `worker_id`'s flag."""

    def __init__(self, flags: mmap.mmap, init_fn):
        self.flags = flags
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        self.flags[worker_id] = 1
        if self.init_fn is not None:
            self.init_fn(worker_id)


class _KeptArgs(multiprocessing.context.ForkProcess):
    """A fork process that keeps its target and arguments after `start()` (which drops them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = {"target": self._target, "args": self._args, "kwargs": self._kwargs}


class _WatchedFork(multiprocessing.context.ForkContext):
    """The fork context whose workers can be started again (`settle` needs their arguments)."""

    Process = _KeptArgs


def watched_iterator(loader, build):
    """`build()` (DataLoader's `_get_iterator`) with its workers watched: each one stuck in its
    fork replaced before the iterator is returned. `loader`'s settings as they were after."""
    if not StartWatch.applies(loader):
        return build()
    watch = StartWatch(loader.num_workers)
    init_fn = loader.worker_init_fn
    context = loader.multiprocessing_context
    # as workers start
    loader.worker_init_fn = _Started(watch.flags, init_fn)
    loader.multiprocessing_context = _WatchedFork()
    try:
        iterator = build()
    finally:
        loader.worker_init_fn = init_fn
        loader.multiprocessing_context = context
    watch.settle(iterator)
    return iterator


class StartWatch:
    """One iterator's (or one isolated child's) start flags: `watched_iterator` raises them from
    each worker's `worker_init_fn`, then `settle`s the iterator; the child raises its own."""

    def __init__(self, num_workers: int):
        self.flags = mmap.mmap(-1, max(1, num_workers))  # anonymous, shared with forked children

    @staticmethod
    def applies(loader) -> bool:
        """Workers by fork on Linux (where /proc shows a stopped process): the case that can
        stick."""
        if loader.num_workers <= 0 or not sys.platform.startswith("linux"):
            return False
        context = loader.multiprocessing_context or multiprocessing.get_context()
        return context.get_start_method() == "fork"

    def settle(self, iterator, seconds: float | None = None) -> int:
        """Waits until each live worker of `iterator` has started, replacing the ones silent
        for `seconds` (default `START_SECONDS`); the number replaced."""
        workers = getattr(iterator, "_workers", None)
        if not workers:
            return 0
        if seconds is None:
            seconds = START_SECONDS
        deadline = time.monotonic() + seconds
        replaced = 0
        while True:
            silent = [i for i, w in enumerate(workers) if not self.flags[i] and w.exitcode is None]
            if not silent:  # a worker that died is DataLoader's to report
                return replaced
            if time.monotonic() < deadline:
                time.sleep(0.002)
                continue
            if replaced >= REPLACEMENTS:
                warnings.warn(
                    f"DataLoader workers {silent} have not started after {seconds:g} s and "
                    f"{replaced} replacements; left as they are (a machine this loaded needs "
                    "fewer workers).",
                    LoaderWarning,
                    stacklevel=4,
                )
                return replaced
            for i in silent:
                replaced += self._replace(iterator, i, seconds)
            deadline = time.monotonic() + seconds

    def started(self, process, seconds: float | None = None) -> bool:
        """Waits until `process` (flag 0: the isolated loader's child) has started or ended: True;
        False when it stayed silent for `seconds` (default `START_SECONDS`) and was killed."""
        if seconds is None:
            seconds = START_SECONDS
        deadline = time.monotonic() + seconds
        while not self.flags[0] and process.exitcode is None:
            if time.monotonic() >= deadline:
                if not self._killed_if_silent(process, 0):
                    return True
                warnings.warn(
                    f"The isolated loader's child (pid {process.pid}) had not started {seconds:g} "
                    f"s after its fork ({_WHY}); started again.",
                    LoaderWarning,
                    stacklevel=4,
                )
                return False
            time.sleep(0.002)
        return True

    def _killed_if_silent(self, process, i: int) -> bool:
        """Stops `process`, reads flag `i` again: killed (True) unless it started meanwhile."""
        os.kill(process.pid, signal.SIGSTOP)
        _until_stopped(process.pid)
        if self.flags[i]:  # it started as the watch gave up on it: let it go on
            os.kill(process.pid, signal.SIGCONT)
            return False
        process.kill()
        process.join()
        return True

    def _replace(self, iterator, i: int, seconds: float) -> int:
        from torch.utils.data._utils import signal_handling  # torch only where workers are

        old = iterator._workers[i]
        registered = getattr(iterator, "_worker_pids_set", False)
        if registered:  # the killed pid must not reach PyTorch's SIGCHLD check as a failure
            signal_handling._remove_worker_pids(id(iterator))
        killed = self._killed_if_silent(old, i)
        if killed:
            iterator._workers[i] = new = _KeptArgs(**old.kept, daemon=True)
            new.start()
        if registered:
            signal_handling._set_worker_pids(id(iterator), tuple(w.pid for w in iterator._workers))
        if killed:
            warnings.warn(
                f"DataLoader worker {i} (pid {old.pid}) had not started {seconds:g} s after its "
                f"fork ({_WHY}); replaced by pid {new.pid} with the same indices and seed, no "
                "batch lost.",
                LoaderWarning,
                stacklevel=5,
            )
        return int(killed)


def _until_stopped(pid: int, seconds: float = 1.0) -> None:
    """Waits (up to `seconds`) until /proc shows `pid` stopped, so its flag is read after its last
    write."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in (b"T", b"t", b"Z", b"X"):
            return
        time.sleep(0.001)
