"""Fork-safe descriptors: flocks and temp files held by threads, closed in a forked child.

Use when: threads of a process hold flocks or write files while the process may fork (the
main process's download threads while a DataLoader forks its workers). A fork copies every
descriptor into the child, where no thread will ever close it: an inherited flock stays held
for the child's lifetime and deadlocks the next `flock` of that file, and an inherited temp
file stays open in a process that never wrote it. Open such descriptors with `open_held`
and close them with `release`: a child forked meanwhile closes its copies at once.
Cost: one lock, taken by every fork and around each `open_held` and `release`; one dict
entry per descriptor held.
Adapt here: nothing.
Trade-off: the registry is per process and global (every fork must see it); a child cannot
use a descriptor that a parent's thread held, which it could not anyway: the thread that
owns it did not come along.
Copy with: nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading

# Descriptors this process's threads hold right now, each with a token: a closed descriptor's
# number is reused by the next `open`, so `release` closes it only if the token still matches.
# Opening and registering (and unregistering and closing) happen under `_FORK_LOCK`, which a
# fork takes first: no fork lands between a descriptor's `open` and its registration.
_HELD: dict[int, object] = {}
_FORK_LOCK = threading.Lock()


def _close_held_after_fork() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _FORK_LOCK.release()  # taken by the forking thread (`before`)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_FORK_LOCK.acquire,
        after_in_parent=_FORK_LOCK.release,
        after_in_child=_close_held_after_fork,
    )


def open_held(path, flags: int) -> tuple[int, object]:
    """`os.open(path, flags, 0o600)`, registered: a child forked while it is open closes it.

    Returns:
        `(fd, token)`, to pass to `release`.
    """
    with _FORK_LOCK:
        fd = os.open(path, flags, 0o600)
        token = _HELD[fd] = object()
    return fd, token


def release(fd: int, token: object) -> None:
    """Closes `fd` unless a fork closed it already (then the number may be another file's)."""
    with _FORK_LOCK:
        if _HELD.get(fd) is token:
            del _HELD[fd]
            os.close(fd)


def held_count() -> int:
    """How many registered descriptors this process holds right now (0 when all are released)."""
    return len(_HELD)
