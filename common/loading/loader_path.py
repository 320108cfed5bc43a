"""Which path `make_loader` takes: worker processes (`StatefulLoader`) or threads (`ThreadLoader`).

Use when: reading why `make_loader` returned a `ThreadLoader` (`loader.recipe.reasons["path"]`)
or forcing a path (`make_loader(..., path="workers")` or `path="threads"`). A path `autotune`
measured for the dataset (`recipes tune --step`) wins over the rules (`from_tuned`).
Cost: one `thread_batches()` call on the dataset.
Adapt here: `WORKER_ONLY`, the arguments that ask for worker processes.
Trade-off: "auto" takes threads only for a dataset that says its batches are made by code
that releases the GIL (`ThreadBatched.thread_batches()`: `TokenCache` and `SpectrogramCache`
with their caches, `ImageFolderFast` without a `transform`, from its cache or decoding files
with TurboJPEG/OpenCV) and only when no argument asks for workers: Python per-item work in threads
holds the GIL, so anything else keeps its worker processes. The rule is checked by
measurement on both built-in image sets (`tests/vision/test_throughput.py`; `recipes bench
vision --set both` measures it on your machine): cold decoding in threads beat a DataLoader
worker 1.70x on photographs (81% of the decode-only limit) and tied it (1.01x) on small
generated JPEGs, 2 cores, 2026-12-01.
Copy with: common/resume/loader_contract.py, common/sizing/resources.py, common/sizing/sizing.py.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import ConcatDataset, IterableDataset

from recipes.common.resume.loader_contract import ThreadBatched

PATHS = ("auto", "isolated", "threads", "workers")
# Arguments of worker processes: given by the user, they choose the worker path.
WORKER_ONLY = (
    "num_workers",
    "prefetch_factor",
    "persistent_workers",
    "worker_init_fn",
    "multiprocessing_context",
    "timeout",
    "pin_memory_device",
    "in_order",
)
# Arguments of the thread path only (ThreadLoader's own).
THREAD_ONLY = ("threads", "prefetch", "seed")
# Fewer batches than this an epoch: the thread path stays in this process (`isolate`).
ISOLATE_MIN_BATCHES = 16
ISOLATED_WHY = (
    "; the threads run in one child process (IsolatedLoader), whose GIL is its own: beside a "
    "training step that holds the GIL (an eager step's Python), threads of this process wait for "
    "it (`recipes bench step`, docs/choosing-a-path.md); measured against the loop: from the next "
    "epoch, threads of this process while the loop's thread waits with the GIL released "
    "(`reasons['path_measured']` says when); path='threads' keeps them in this process"
)
# What a ThreadLoader takes from make_loader's settings.
THREAD_KEYS = (
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "drop_last",
    "generator",
    "pin_memory",
    "collate_fn",
)


def isolated_available() -> bool:
    """Whether this platform can fork the isolated loader's child (Linux and macOS)."""
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


def thread_capable(dataset) -> bool | None:
    """None when `dataset` cannot take the thread path at all; else whether it can now
    (`thread_batches()`). A `ConcatDataset` (a mixture's sources) can when every part can."""
    if isinstance(dataset, ConcatDataset):
        parts = [thread_capable(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else all(parts)
    if isinstance(dataset, ThreadBatched) and not isinstance(dataset, IterableDataset):
        return bool(dataset.thread_batches())
    return None


def choose_path(dataset, path: str, overrides: dict[str, Any]) -> tuple[str, str]:
    """`("threads" | "workers", the reason)` for `dataset` under `path` and the user's arguments.

    Raises:
        ValueError: an unknown `path`, or `path="threads"` for a dataset or arguments that
            the thread path cannot serve (naming why).
    """
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}, but is {path!r} instead.")
    if path == "workers":
        return "workers", "given"
    able = thread_capable(dataset) is not None
    ready = bool(able and thread_capable(dataset))
    asked = [key for key in WORKER_ONLY if key in overrides]
    name = type(dataset).__name__
    if path in ("threads", "isolated"):
        if not ready:
            raise ValueError(
                f"path={path!r} needs a map-style dataset whose batches are made by code that "
                f"releases the GIL (thread_batches() true: a cache attached or OpenCV decoding, no "
                f"transform); {name} "
                f"{'has no thread_batches()' if not able else 'cannot now'}. Use path='workers'."
            )
        asked = [key for key in asked if not (path == "isolated" and key == "timeout")]
        if asked:
            raise ValueError(
                f"path={path!r} makes batches in threads (of this process, or of one child "
                f"process); {asked} configure worker processes. Drop them, or use path='workers'."
            )
        if path == "isolated":
            if not isolated_available():
                raise ValueError(
                    "path='isolated' forks a child process, which this platform cannot; use "
                    "path='threads'."
                )
        return path, "given"
    if not ready:
        return "workers", (
            f"worker processes: {name} has no thread_batches() (loader_contract.ThreadBatched)"
            if not able
            else f"worker processes: {name}.thread_batches() is false (no cache attached, or a "
            "transform)"
        )
    if asked:
        return (
            "workers",
            f"worker processes: {', '.join(asked)} given (path='threads' would refuse them)",
        )
    source = (
        "reads its items from a memory-speed cache"
        if getattr(dataset, "cache", True) is not None
        else (
            "decodes its items with TurboJPEG or OpenCV (on photographs, 2 cores, `recipes bench "
            "vision` measured 1.70x the worker path and 81% of the decode-only limit)"
        )
    )
    return "threads", (
        f"threads: {name} {source} (the GIL released); worker processes would add a "
        "shared-memory hand-over and pickling per batch, and leave a core to the training "
        "loop. path='workers' for worker processes"
    )


def isolate(dataset, settings: dict[str, Any], cpus: int, why: str) -> tuple[str, str]:
    """`("isolated" | "threads", the reason)` for "auto" on the thread path, `cpus` those of the
    machine: isolated when a child can be forked, this rank has 2 CPUs or more,
    and an epoch has `ISOLATE_MIN_BATCHES` batches or more (a fork and its first batches cost
    a few batches' time)."""
    import math
    import multiprocessing

    batches = None
    try:
        if settings.get("batch_sampler") is not None:
            batches = len(settings["batch_sampler"])
        else:
            sampler = settings.get("sampler")
            batches = math.ceil(
                len(sampler if sampler is not None else dataset)
                / max(1, settings.get("batch_size") or 1)
            )
    except TypeError:  # a sampler without a length
        pass
    cpus = max(1, cpus // _local_ranks())
    if not isolated_available() or multiprocessing.current_process().daemon:
        return (
            "threads",
            why + "; in this process: no child process can be forked here (path='isolated' refuses "
            "too)",
        )
    if cpus < 2:
        return (
            "threads",
            why + f"; in this process: {cpus} CPU for this rank, which the loop and a child would "
            "share",
        )
    if batches is not None and batches < ISOLATE_MIN_BATCHES:
        return "threads", why + (
            f"; in this process: {batches} batches an epoch, fewer than {ISOLATE_MIN_BATCHES} "
            "(a child's fork and first batches would cost more than they win)"
        )
    return "isolated", why.replace("threads:", "isolated threads:", 1) + ISOLATED_WHY


def from_tuned(record: dict[str, Any] | None, extras: dict[str, Any]) -> tuple[str, str] | None:
    """The path `autotune` / `recipes tune` measured best for this dataset (`record`, from the
    tuned-settings store), with its reason, when "auto" may take it: the dataset can take the
    thread path now (the caller's condition), no thread argument is given (`extras`: then the
    thread path stays), and an isolated path can still fork here. None: the rules decide."""
    import multiprocessing

    stored = ((record or {}).get("settings") or {}).get("path")
    if stored not in ("threads", "isolated", "workers") or (extras and stored == "workers"):
        return None
    if stored == "isolated" and (
        not isolated_available() or multiprocessing.current_process().daemon
    ):
        return None
    where = {
        "threads": "threads of this process",
        "isolated": "threads of one child process (IsolatedLoader)",
        "workers": "worker processes",
    }[stored]
    measured = str(record.get("reason") or "").removeprefix("autotune: ")
    return stored, (
        f"{where}: autotuned {record.get('when', '')} on this machine, the thread paths and worker "
        f"counts measured{' beside ' + record['step'] if record.get('step') else ''}: "
        f"{measured or 'the best measured'} (recipes tune; tuned=False ignores it, path= chooses)"
    )


def _local_ranks() -> int:
    from recipes.common.sizing.sizing import local_world_size_from_env

    return local_world_size_from_env()


def check_niceness(niceness) -> None:
    """Raises ValueError unless `niceness` is an int from 0 to 19 (os.nice's range)."""
    if not isinstance(niceness, int) or isinstance(niceness, bool) or not 0 <= niceness <= 19:
        raise ValueError(
            "`niceness` must be an int from 0 (the loop's own priority) to 19, but is "
            f"{niceness!r} instead."
        )


def child_arguments(
    path: str,
    chosen: str,
    why: str,
    overrides: dict[str, Any],
    settings: dict[str, Any],
    reasons: dict[str, str],
    extras: dict[str, Any],
) -> None:
    """The isolated path's own arguments (`timeout`, `niceness`: its child's) from `settings` into
    `extras` when `chosen` is it. Elsewhere `timeout` stays DataLoader's; `niceness` is refused on a
    path the user chose, and noted as unused where "auto" chose a path without a child."""
    given = "niceness" in overrides
    niceness = settings.pop("niceness", None)
    if given:
        check_niceness(
            niceness
        )  # whichever path (None too): a bad value is a mistake even where no child uses it
    if chosen == "isolated":
        extras.update({key: settings.pop(key) for key in ("timeout",) if key in overrides})
        if given:
            extras["niceness"] = niceness
    elif given:
        if path != "auto":  # the user's own path has no child to lower
            raise TypeError(
                "`niceness` sets the priority of IsolatedLoader's child process, but "
                f"path={path!r} has none; drop it, or pass path='isolated'."
            )
        reasons["niceness"] = f"{niceness}: unused, no child process ({why})"
