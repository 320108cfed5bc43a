"""RobustLoader: an epoch survives dead, hung or unstartable workers, with nothing lost or repeated.

Use when: a long run must not lose an epoch to the OOM killer taking a worker, a bus error
from a full `/dev/shm`, a worker that hangs on a bad file system, or a fork that fails.
PyTorch raises in all of these and the epoch is gone; so is the run, unless it restarts.
Cost: nothing until a failure (it iterates a `make_loader` loader). On a failure: the broken
workers are shut down and a new loader is built one step down the ladder, resumed at the
first batch the loop has not received (`StatefulLoader` state: index-level skip, no data
re-read for map-style datasets).
Adapt here: `ladder=` (a list of setting changes, applied cumulatively), `_cause` for error
texts of other failure kinds.
Trade-off: restarts cost a worker start-up each; after `max_restarts` the error is raised.
Errors raised by the dataset itself (a bad file, a bug) are never retried: they would fail
again.
Copy with: common/caches/cache_files.py, common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated/child.py,
  common/loading/isolated/protocol.py, common/loading/isolated_loader.py, common/loading/loader.py,
  common/loading/loader_path.py, common/loading/loader_rules.py, common/loading/loop_probe.py,
  common/loading/stateful_loader.py, common/loading/thread_loader.py,
  common/loading/worker_rules.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_resume.py, common/resume/loader_state.py,
  common/resume/order_sources.py, common/resume/pass_sampler.py, common/resume/state_keys.py,
  common/resume/state_records.py, common/sampling/elastic_sampler.py, common/sampling/sharding.py,
  common/sizing/profiles.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/sizing/tune_store.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import re
import time
import warnings
from typing import Any

from torch.utils.data import IterableDataset

from recipes.common.loader_warning import LoaderWarning
from recipes.common.loading.isolated_loader import (
    IsolatedHandOverError,
    IsolatedLoader,
    IsolatedProcessDied,
    IsolatedProcessHung,
)
from recipes.common.loading.loader import make_loader
from recipes.common.loading.loader_path import choose_path
from recipes.common.resume.loader_contract import ResumableIterable
from recipes.common.resume.loader_counting import SHM_FAILURES

# What a failure of the loading machinery (not of the dataset's code) says.
_SHM = SHM_FAILURES
_DEATH = ("exited unexpectedly", "is killed by signal")
_START = ("cannot allocate memory", "resource temporarily unavailable", "too many open files")
_POLL_SECONDS = 1.0


class RobustLoader:
    """Iterates like the `make_loader` loader it wraps, restarting it lower on a ladder on failure.

    Args:
        dataset: a map-style or iterable Dataset.
        batch_size, sampler, batch_sampler, collate_fn: as for DataLoader.
        ladder: setting changes to try in turn, cumulatively; by default fewer workers
            (halved), then `prefetch_factor=1`, then `pin_memory=False`, finally 0 workers.
        max_restarts: failures survived per epoch before the error is raised.
        timeout: seconds a batch may take before its worker counts as hung (with workers).
        **loader_kwargs: passed to `make_loader` (`num_workers`, `shuffle`, `profile`, ...).

    Example:
        >>> loader = RobustLoader(dataset, batch_size=64, shuffle=True, timeout=120)
        >>> for batch in loader:   # a worker SIGKILLed mid-epoch costs a restart, not the epoch
        ...     step(batch)
        >>> loader.restarts        # [(cause, settings), ...]
    """

    def __init__(
        self,
        dataset,
        *,
        batch_size: int | None = None,
        sampler=None,
        batch_sampler=None,
        collate_fn=None,
        ladder: list[dict[str, Any]] | None = None,
        max_restarts: int = 3,
        timeout: float = 300.0,
        **loader_kwargs: Any,
    ):
        if max_restarts < 0 or timeout <= 0:
            raise ValueError(
                f"`max_restarts` must be non-negative and `timeout` positive, but are "
                f"{max_restarts!r} and {timeout!r} instead."
            )
        given = {"sampler": sampler, "batch_sampler": batch_sampler, "collate_fn": collate_fn}
        self._kwargs = {k: v for k, v in given.items() if v is not None} | loader_kwargs
        self.dataset = dataset
        self.batch_size = batch_size
        self.timeout = timeout
        self.max_restarts = max_restarts
        self._ladder = ladder
        self.restarts: list[tuple[str, dict[str, Any]]] = []
        self.loader = self._build({})

    def _build(self, changes: dict[str, Any]):
        # DataLoader's own timeout is a poll (it ignores it without workers): each expiry is a
        # chance to notice a dead worker inside next(); `self.timeout` bounds the whole wait.
        # The thread path has no workers to watch: it gets none (it would refuse it, and "auto"
        # would take worker processes for it).
        kwargs = {**self._kwargs, **changes}
        if (
            changes.get("path", "isolated") != "isolated"
        ):  # down from the child to threads: nothing to lower
            kwargs.pop("niceness", None)
        if choose_path(self.dataset, kwargs.get("path", "auto"), kwargs).setting == "workers":
            kwargs["timeout"] = min(_POLL_SECONDS, self.timeout)
        loader = make_loader(self.dataset, batch_size=self.batch_size, **kwargs)
        if isinstance(loader, IsolatedLoader):  # its child is watched for a hang as workers are
            loader.timeout = self.timeout
        return loader

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self):
        """The current loader's sampler: frameworks set its epoch through it (Lightning calls
        `loader.sampler.set_epoch(epoch)` before each epoch). A restart keeps the same object."""
        return self.loader.sampler

    @property
    def batch_sampler(self):
        """The current loader's batch sampler (Lightning reaches `batch_sampler.sampler`)."""
        return self.loader.batch_sampler

    def close(self) -> None:
        """Shuts the current loader's persistent workers down now (`StatefulLoader.close`)."""
        self.loader.close()

    def __enter__(self) -> RobustLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self):
        """Batches of one epoch. A failure is survived wherever the loop meets it: in `next()`,
        and in `iter()` itself, where persistent workers that died between epochs (the OOM
        killer during validation or a checkpoint) are found by DataLoader's `_reset`."""
        failures = 0
        iterator = None
        while True:
            try:
                if iterator is None:
                    iterator = _own_failures(iter(self.loader))
                batch = self._next(iterator)
            except StopIteration:
                return
            except (RuntimeError, OSError, EOFError) as error:
                broken = iterator
                if broken is None:
                    broken = self.loader._iterator
                cause = _cause(error) or _worker_died(broken)
                if cause is None or failures >= self.max_restarts:
                    raise
                failures += 1
                state = self.loader.state_dict()
                _shut_down(broken, kill_first=cause == "hang")
                self._step_down(cause, state["batches_yielded"])
                self.loader.load_state_dict(state)
                iterator = None
                continue
            yield batch

    def _next(self, iterator):
        """`next(iterator)`, polling: a dead worker is found within a poll, a hang after
        `timeout`."""
        waited = 0.0
        while True:
            start = time.monotonic()
            try:
                return next(iterator)
            except RuntimeError as error:
                if not _own_timeout(
                    error
                ):  # a dataset's or worker's error that mentions a timeout: not ours
                    raise
                waited += time.monotonic() - start
                if waited >= self.timeout:
                    raise _Hang(
                        f"DataLoader timed out after {self.timeout:g} seconds waiting for one "
                        "batch (RobustLoader)"
                    ) from error

    def _step_down(self, cause: str, resume_at: int) -> None:
        settings = self.loader.recipe.settings
        changes = _next_rung(self._ladder, self.restarts, settings, cause)
        if resume_at and _replays(self.dataset):  # its rest is made by as many workers as its start
            changes = {k: v for k, v in changes.items() if k != "num_workers"}
            if not changes and settings.get("prefetch_factor", 2) > 1:
                changes = {"prefetch_factor": 1}
        self.loader = self._build(
            {k: v for step in [*(c for _, c in self.restarts), changes] for k, v in step.items()}
        )
        self.restarts.append((cause, changes))
        hint = _HINTS.get(cause, "")
        what = _DESCRIBE[cause]
        if settings.get("path") == "isolated":
            what = {
                "death": (
                    "the isolated loader's child process died (OOM killer, segfault, or a signal)"
                ),
                "hang": "the isolated loader's child process hung past the timeout",
                "shm": (
                    "the isolated loader's child could not hand a batch over (shared memory, or a "
                    "batch that does not cross)"
                ),
            }.get(cause, what)
        warnings.warn(
            f"RobustLoader: {what}; restarting with {changes} and resuming at batch "
            f"{resume_at} of the epoch.{hint}",
            LoaderWarning,
            stacklevel=3,
        )


_DESCRIBE = {
    "death": "a DataLoader worker died (OOM killer, segfault, or a signal)",
    "hang": "a DataLoader worker hung past the timeout",
    "shm": "shared memory failed (/dev/shm full: bus error or no space)",
    "start": "DataLoader workers could not start",
}
# What a failure's warning adds, by cause.
_HINTS = {
    "shm": (
        " /dev/shm is too small for the batches in flight: run the container with "
        "--shm-size=8g (or --ipc=host)."
    ),
}


class _Hang(RuntimeError):
    """No batch within RobustLoader's `timeout`: a hung worker."""


def _own_timeout(error: BaseException) -> bool:
    """DataLoader's own `timeout=` expiry, exactly its message, not a dataset's error that
    happens to say "timed out after" (a subprocess timeout in a worker comes back as "Caught
    TimeoutExpired in DataLoader worker process ...")."""
    return (
        type(error) is RuntimeError
        and re.fullmatch(r"DataLoader timed out after [0-9.e+-]+ seconds", str(error)) is not None
    )


def _cause(error: BaseException) -> str | None:
    """The kind of loading failure `error` is, or None for an error of the dataset's own.
    Deaths and hangs are DataLoader's own errors ("DataLoader worker (pid ...) ...", "DataLoader
    timed out after"); an error a worker raised comes back as "Caught ... in DataLoader worker
    process", and only a full /dev/shm is recognised inside one."""
    if isinstance(error, IsolatedProcessDied):
        return "death"
    if isinstance(error, IsolatedHandOverError):
        return "shm"
    if isinstance(error, IsolatedProcessHung):
        return "hang"
    text = str(error).lower()
    if any(s in text for s in _SHM):
        return "shm"
    if text.startswith("dataloader worker (pid") and any(s in text for s in _DEATH):
        return "death"
    if isinstance(error, _Hang):
        return "hang"
    if isinstance(error, OSError) and any(s in text for s in _START):
        return "start"
    return None


def _worker_died(iterator) -> str | None:
    """ "death" when one of the iterator's workers has exited: the error was a symptom (a batch
    whose shared memory its dead sender was still serving: ConnectionResetError, EOFError)."""
    inner = getattr(iterator, "_inner", iterator)
    workers = getattr(inner, "_workers", ())
    deadline = time.monotonic() + _POLL_SECONDS  # its sockets close a moment before it is reaped
    while workers:
        if any(w.exitcode is not None for w in workers):
            return "death"
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    return None


def _replays(dataset) -> bool:
    """An iterable dataset without `resume_after`: resumed mid-epoch by replaying its start, or
    by its workers' own states, either of which needs the worker count the epoch began with."""
    return isinstance(dataset, IterableDataset) and not isinstance(dataset, ResumableIterable)


def _next_rung(ladder, restarts, settings: dict[str, Any], cause: str) -> dict[str, Any]:
    """The next change: the user's ladder in order, else fewer workers, prefetch 1, no pinning, 0
    workers."""
    if ladder is not None:
        if len(restarts) >= len(ladder):
            return {"num_workers": 0}
        return dict(ladder[len(restarts)])
    if settings.get("path") == "isolated":
        # its child died or hung: a new child once, then this process's threads
        if any(c.get("path") == "isolated" for _, c in restarts):
            return {"path": "threads"}
        return {"path": "isolated"}
    workers = settings.get("num_workers", 0)
    if cause == "shm" or workers == 0:
        return {"num_workers": 0}  # shared memory cannot be fixed from here: no IPC at all
    if workers > 1:
        return {"num_workers": workers // 2}
    if settings.get("prefetch_factor", 2) > 1:
        return {"prefetch_factor": 1}
    if settings.get("pin_memory"):
        return {"pin_memory": False}
    return {"num_workers": 0}


def _own_failures(iterator):
    """Takes the iterator's workers off PyTorch's SIGCHLD handler, which would raise a worker's
    death in whatever the main thread runs at that moment (the training step, beyond any
    retry); the iterator itself notices the death within 5 s, inside `next()`."""
    inner = getattr(iterator, "_inner", iterator)
    if getattr(inner, "_worker_pids_set", False):
        from torch.utils.data._utils import signal_handling

        signal_handling._remove_worker_pids(id(inner))
        inner._worker_pids_set = False
    return iterator


def _shut_down(iterator, kill_first: bool = False) -> None:
    """Ends the broken iterator's workers now. After a hang they are killed first: PyTorch's
    shutdown would wait 5 s on each hung worker's join before terminating it."""
    inner = getattr(iterator, "_inner", iterator)
    child_of = getattr(getattr(inner, "_loader", None), "_stop_child", None)
    if (
        child_of is not None
    ):  # an IsolatedLoader's epoch: its child process ended now (killed when hung)
        child_of()
    if kill_first:
        for worker in getattr(inner, "_workers", []):
            if worker.is_alive():
                worker.kill()
    shutdown = getattr(inner, "_shutdown_workers", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # already half torn down by the failure
            pass
