"""Process lifetime: workers that die with their parent, and whether a pid is alive.

Use when: a DataLoader or build worker must not outlive a parent that was killed
(`die_with_parent`, armed in a worker's init), or a temp file or lock names a pid whose owner
may be gone (`pid_alive`).
Cost: one prctl on Linux; elsewhere a daemon thread polling the parent pid once a second.
Adapt here: nothing.
Trade-off: the worker gets SIGKILL when its parent dies: no cleanup runs in it, so it must
write only temp files that a later run sweeps.
Copy with: nothing.
"""

from __future__ import annotations

import os
import sys


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> None:
    """Ends this (worker) process when its parent dies, even if it is blocked in a write."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return  # not a multiprocessing child (0 workers): nothing to tie
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    else:
        import threading

        threading.Thread(target=exit_when_orphaned, args=(parent.pid,), daemon=True).start()
    if os.getppid() != parent.pid:  # the parent died before the signal was armed
        os._exit(1)


def exit_when_orphaned(parent_pid: int) -> None:
    """Polls once a second until this process's parent is no longer `parent_pid`, then exits
    (a thread's body: a death signal where prctl is missing, or tied to a short-lived thread)."""
    import time

    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def lower_priority(niceness: int) -> None:
    """The calling thread's scheduling priority `niceness` levels down (`os.nice`), and that of the
    threads it starts from now on (Linux schedules threads)."""
    if niceness:
        try:
            os.nice(niceness)
        except OSError:  # a sandbox that refuses it: the process runs at its parent's priority
            pass
