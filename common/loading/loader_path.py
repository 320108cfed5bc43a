"""Which path `make_loader` takes: worker processes (`StatefulLoader`) or threads (`ThreadLoader`),
in this process or in one child (`IsolatedLoader`); each rule a small named function.

Use when: reading why `make_loader` returned a `ThreadLoader` (`loader.recipe.reasons["path"]`)
or forcing a path (`make_loader(..., path="workers")` or `path="threads"`). A path `autotune`
measured for the dataset (`recipes tune --step`) wins over the rules (`autotuned_path`).
Cost: one `thread_batches()` call on the dataset.
Adapt here: `WORKER_ONLY`, the arguments that ask for worker processes; `Decision` and `decide`,
a rule's answer and the run of a table (every table of `make_loader`'s); the tables `PATH_RULES`
(workers or threads) and `THREAD_PATH_RULES` (threads of this process or of a child), run in
order, the first rule that answers deciding. See NOTE [the GIL and the thread paths].
Trade-off: "auto" takes threads only for a dataset that says its batches are made by code
that releases the GIL (`ThreadBatched.thread_batches()`: `TokenCache` and `SpectrogramCache`
with their caches, `ImageFolderFast` without a `transform`, from its cache or decoding files
with TurboJPEG/OpenCV) and only when no argument asks for workers. The rule is checked by
measurement on both built-in image sets (`tests/vision/test_throughput.py`; `recipes bench
vision --set both` measures it on your machine): cold decoding in threads beat a DataLoader
worker 1.70x on photographs (81% of the decode-only limit) and tied it (1.01x) on small
generated JPEGs, 2 cores, 2026-12-01.
Copy with: common/resume/loader_contract.py, common/sizing/resources.py, common/sizing/sizing.py.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch.utils.data import ConcatDataset, IterableDataset

from recipes.common.resume.loader_contract import ThreadBatched
from recipes.common.sizing.sizing import local_world_size_from_env

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
# Fewer batches than this an epoch: the thread path stays in this process (`short_epoch`).
ISOLATE_MIN_BATCHES = 16
# See NOTE [the GIL and the thread paths]
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


@dataclass(frozen=True)
class Decision:
    """What one rule chose: `setting` for `key`, and `reason`, the sentence that
    `loader.recipe.reasons[key]` shows. `rule`: the deciding rule's name (`decide` fills it)."""

    key: str
    setting: Any
    reason: str
    rule: str = ""


Rule = Callable[[Any], "Decision | None"]


def decide(rules: Sequence[Rule], facts: Any) -> Decision | None:
    """The decision of the first rule in `rules` that answers for `facts`, named; None when no
    rule does."""
    for rule in rules:
        decision = rule(facts)
        if decision is not None:
            return replace(decision, rule=rule.__name__)
    return None


# NOTE [the GIL and the thread paths]
# Threads of one process share its GIL. A dataset whose batches are made by code that releases
# it (`ThreadBatched.thread_batches()`: a memory-speed cache read, TurboJPEG/OpenCV decoding)
# runs in threads as fast as in worker processes, without their shared-memory hand-over and
# pickling per batch, and leaves a core to the training loop; Python per-item work in threads
# holds the GIL, so anything else keeps its worker processes. Beside a training step that itself
# holds the GIL (an eager step's Python), threads of the loop's process wait for it: the isolated
# path runs the same threads in one child process, whose GIL is its own (`IsolatedLoader`), and
# its probe of the loop (`LoopProbe`) moves them back into this process when the loop's thread
# waits with the GIL released. Measured: `recipes bench step`, docs/choosing-a-path.md.


def isolated_available() -> bool:
    """Whether this platform can fork the isolated loader's child (Linux and macOS)."""
    return "fork" in multiprocessing.get_all_start_methods()


def can_fork_here() -> bool:
    """Whether a child can be forked from here: the platform can, and this is no daemon process
    (a DataLoader worker's, which may have no children)."""
    return isolated_available() and not multiprocessing.current_process().daemon


def thread_capable(dataset) -> bool | None:
    """None when `dataset` cannot take the thread path at all; else whether it can now
    (`thread_batches()`). A `ConcatDataset` (a mixture's sources) can when every part can."""
    if isinstance(dataset, ConcatDataset):
        parts = [thread_capable(d) for d in dataset.datasets]
        if any(p is None for p in parts):
            return None
        return all(parts)
    if isinstance(dataset, ThreadBatched) and not isinstance(dataset, IterableDataset):
        return bool(dataset.thread_batches())
    return None


@dataclass(frozen=True)
class PathFacts:
    """What the path rules read: the path asked for, the dataset's class name, whether it has
    `thread_batches()` (`able`) and it is true now (`ready`), the worker arguments given
    (`asked`), and whether it reads a memory-speed cache."""

    path: str
    name: str
    able: bool
    ready: bool
    asked: tuple[str, ...]
    from_cache: bool


def path_facts(dataset, path: str, overrides: dict[str, Any]) -> PathFacts:
    capable = None
    if path != "workers":  # a path given as workers asks the dataset nothing
        capable = thread_capable(dataset)
    asked = tuple(key for key in WORKER_ONLY if key in overrides)
    from_cache = getattr(dataset, "cache", True) is not None
    return PathFacts(
        path, type(dataset).__name__, capable is not None, bool(capable), asked, from_cache
    )


def given_path(f: PathFacts) -> Decision | None:
    if f.path == "auto":
        return None
    return Decision("path", f.path, "given")


def no_thread_batches(f: PathFacts) -> Decision | None:
    if f.able:
        return None
    reason = f"worker processes: {f.name} has no thread_batches() (loader_contract.ThreadBatched)"
    return Decision("path", "workers", reason)


def thread_batches_false(f: PathFacts) -> Decision | None:
    if f.ready:
        return None
    reason = (
        f"worker processes: {f.name}.thread_batches() is false (no cache attached, or a transform)"
    )
    return Decision("path", "workers", reason)


def worker_arguments_given(f: PathFacts) -> Decision | None:
    if not f.asked:
        return None
    reason = f"worker processes: {', '.join(f.asked)} given (path='threads' would refuse them)"
    return Decision("path", "workers", reason)


def _threads_reason(name: str, source: str) -> str:
    # See NOTE [the GIL and the thread paths]
    return (
        f"threads: {name} {source} (the GIL released); worker processes would add a "
        "shared-memory hand-over and pickling per batch, and leave a core to the training "
        "loop. path='workers' for worker processes"
    )


def reads_a_cache(f: PathFacts) -> Decision | None:
    if not f.from_cache:
        return None
    source = "reads its items from a memory-speed cache"
    return Decision("path", "threads", _threads_reason(f.name, source))


def decodes_in_threads(f: PathFacts) -> Decision | None:
    source = (
        "decodes its items with TurboJPEG or OpenCV (on photographs, 2 cores, `recipes bench "
        "vision` measured 1.70x the worker path and 81% of the decode-only limit)"
    )
    return Decision("path", "threads", _threads_reason(f.name, source))


# First match: workers or threads ("isolated" too when given).
PATH_RULES: tuple[Rule, ...] = (
    given_path,
    no_thread_batches,
    thread_batches_false,
    worker_arguments_given,
    reads_a_cache,
    decodes_in_threads,
)


def check_given_path(f: PathFacts) -> None:
    """Raises ValueError when `path="threads"` or `"isolated"` cannot serve the dataset or the
    arguments, naming why."""
    if f.path not in ("threads", "isolated"):
        return
    if not f.ready:
        state = "cannot now"
        if not f.able:
            state = "has no thread_batches()"
        raise ValueError(
            f"path={f.path!r} needs a map-style dataset whose batches are made by code that "
            f"releases the GIL (thread_batches() true: a cache attached or OpenCV decoding, no "
            f"transform); {f.name} {state}. Use path='workers'."
        )
    asked = [key for key in f.asked if not (f.path == "isolated" and key == "timeout")]
    if asked:
        raise ValueError(
            f"path={f.path!r} makes batches in threads (of this process, or of one child "
            f"process); {asked} configure worker processes. Drop them, or use path='workers'."
        )
    if f.path == "isolated" and not isolated_available():
        raise ValueError(
            "path='isolated' forks a child process, which this platform cannot; use path='threads'."
        )


def choose_path(dataset, path: str, overrides: dict[str, Any]) -> Decision:
    """The path (`"threads" | "isolated" | "workers"`, `.setting`) for `dataset` under `path` and
    the user's arguments, with its reason (`PATH_RULES`).

    Raises:
        ValueError: an unknown `path`, or `path="threads"` for a dataset or arguments that
            the thread path cannot serve (naming why).
    """
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}, but is {path!r} instead.")
    facts = path_facts(dataset, path, overrides)
    check_given_path(facts)
    return decide(PATH_RULES, facts)


@dataclass(frozen=True)
class ThreadPathFacts:
    """What the thread-path rules read under "auto": the threads' reason (`why`), the dataset and
    settings (for the epoch's batches), the machine's CPUs, the tuned record (or None) and the
    thread arguments given (`extras`)."""

    why: str
    dataset: Any
    settings: dict[str, Any]
    cpus: int
    record: dict[str, Any] | None
    extras: dict[str, Any]

    def rank_cpus(self) -> int:
        return max(1, self.cpus // local_world_size_from_env())

    def epoch_batches(self) -> int | None:
        """Batches an epoch, None for a sampler without a length."""
        try:
            if self.settings.get("batch_sampler") is not None:
                return len(self.settings["batch_sampler"])
            items = self.settings.get("sampler")
            if items is None:
                items = self.dataset
            return math.ceil(len(items) / max(1, self.settings.get("batch_size") or 1))
        except TypeError:  # a sampler without a length
            return None


# Where each stored path makes batches.
TUNED_WHERE = {
    "threads": "threads of this process",
    "isolated": "threads of one child process (IsolatedLoader)",
    "workers": "worker processes",
}


def autotuned_path(f: ThreadPathFacts) -> Decision | None:
    # `autotune` / `recipes tune` measured it for this dataset; taken unless a thread argument is
    # given (then the thread path stays) or an isolated path cannot fork here.
    record = f.record or {}
    stored = (record.get("settings") or {}).get("path")
    if stored not in TUNED_WHERE or (f.extras and stored == "workers"):
        return None
    if stored == "isolated" and not can_fork_here():
        return None
    measured = str(record.get("reason") or "").removeprefix("autotune: ")
    beside = ""
    if record.get("step"):
        beside = " beside " + record["step"]
    reason = (
        f"{TUNED_WHERE[stored]}: autotuned {record.get('when', '')} on this machine, the thread "
        f"paths and worker counts measured{beside}: {measured or 'the best measured'} (recipes "
        "tune; tuned=False ignores it, path= chooses)"
    )
    return Decision("path", stored, reason)


def no_fork_here(f: ThreadPathFacts) -> Decision | None:
    if can_fork_here():
        return None
    reason = "; in this process: no child process can be forked here (path='isolated' refuses too)"
    return Decision("path", "threads", f.why + reason)


def one_cpu(f: ThreadPathFacts) -> Decision | None:
    cpus = f.rank_cpus()
    if cpus >= 2:
        return None
    reason = f"; in this process: {cpus} CPU for this rank, which the loop and a child would share"
    return Decision("path", "threads", f.why + reason)


def short_epoch(f: ThreadPathFacts) -> Decision | None:
    batches = f.epoch_batches()
    if batches is None or batches >= ISOLATE_MIN_BATCHES:
        return None
    reason = (
        f"; in this process: {batches} batches an epoch, fewer than {ISOLATE_MIN_BATCHES} "
        "(a child's fork and first batches would cost more than they win)"
    )
    return Decision("path", "threads", f.why + reason)


def isolated_child(f: ThreadPathFacts) -> Decision | None:
    # See NOTE [the GIL and the thread paths]
    reason = f.why.replace("threads:", "isolated threads:", 1) + ISOLATED_WHY
    return Decision("path", "isolated", reason)


# First match, when "auto" took threads: the measured path, else in this process or a child.
THREAD_PATH_RULES: tuple[Rule, ...] = (
    autotuned_path,
    no_fork_here,
    one_cpu,
    short_epoch,
    isolated_child,
)


def check_niceness(niceness) -> None:
    """Raises ValueError unless `niceness` is an int from 0 to 19 (os.nice's range)."""
    if not isinstance(niceness, int) or isinstance(niceness, bool) or not 0 <= niceness <= 19:
        raise ValueError(
            "`niceness` must be an int from 0 (the loop's own priority) to 19, but is "
            f"{niceness!r} instead."
        )


def child_arguments(
    path: str,
    chosen: Decision,
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
        # whichever path (None too): a bad value is a mistake even where no child uses it
        check_niceness(niceness)
    if chosen.setting == "isolated":
        extras.update({key: settings.pop(key) for key in ("timeout",) if key in overrides})
        if given:
            extras["niceness"] = niceness
    elif given:
        if path != "auto":  # the user's own path has no child to lower
            raise TypeError(
                "`niceness` sets the priority of IsolatedLoader's child process, but "
                f"path={path!r} has none; drop it, or pass path='isolated'."
            )
        reasons["niceness"] = f"{niceness}: unused, no child process ({chosen.reason})"
