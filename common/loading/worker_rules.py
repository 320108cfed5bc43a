"""`make_loader`'s rules for worker processes: the start method, `worker_init_fn` and the sharing
strategy, each a small named function returning a `Decision`; the copy-on-read warning.

Use when: reading why `loader.recipe.reasons` says what it says of `multiprocessing_context`,
`worker_init_fn` or `sharing_strategy`, or adding a rule for worker processes.
Cost: none: the rules read the settings, the platform's start methods and `ulimit -n`.
Adapt here: `START_METHOD_RULES` (the first rule that answers decides) and `SAFETY_RULES` (every
rule that answers applies), run in order by `make_loader` when there are workers.
Trade-off: switching to the `file_system` sharing strategy is process-wide (torch offers no
per-loader switch): `file_system_sharing` asks for it only when `ulimit -n` is too low.
Copy with: common/loader_warning.py, common/loading/loader_path.py,
  common/resume/loader_contract.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/workers/process_lifetime.py, common/workers/worker.py.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from recipes.common.loader_warning import LoaderWarning
from recipes.common.loading.loader_path import Decision, Rule, decide
from recipes.common.workers.worker import ChainedWorkerInit

# Below this soft `ulimit -n`, DataLoader's default `file_descriptor` sharing strategy runs
# out of descriptors once a few hundred shared tensors are alive.
LOW_NOFILE = 4096
# Python containers larger than this on a dataset cost forked workers real memory (copy-on-read).
COPY_ON_READ_ITEMS = 100_000
# The DataLoader arguments it rejects with 0 workers.
WORKER_ARGUMENTS = ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout")
ZERO_WORKERS_DROPPED = "dropped: DataLoader rejects it with 0 workers"
# The one decision that is not a DataLoader argument: torch's process-wide sharing strategy.
SHARING_STRATEGY = "sharing_strategy"


@dataclass(frozen=True)
class WorkerFacts:
    """What the safety rules read: the dataset, the settings so far, the user's own keys, the
    soft `ulimit -n`, and the platform's start methods."""

    dataset: Any
    settings: Mapping[str, Any]
    user_keys: frozenset[str]
    nofile_limit: int
    methods: tuple[str, ...]
    linux: bool


def worker_facts(dataset, settings, user_keys, nofile_limit: int) -> WorkerFacts:
    methods = tuple(multiprocessing.get_all_start_methods())
    linux = sys.platform.startswith("linux")
    return WorkerFacts(dataset, dict(settings), frozenset(user_keys), nofile_limit, methods, linux)


def start_method_name(context) -> str:
    """A `multiprocessing_context` setting's start method: the string itself, or the context's."""
    if isinstance(context, str):
        return context
    return context.get_start_method()


# NOTE [fork and CUDA]
# Worker processes (and the isolated loader's child) start with `fork`, also after CUDA is
# initialised in the parent: a forked child cannot use CUDA, but forking is safe while the child
# itself never touches it, which PyTorch's own default relies on. `forkserver` or `spawn` would
# re-import torch in every worker (a 15-54 s first batch on a 16-core GPU node) and crash scripts
# without an `if __name__ == "__main__":` guard. A dataset whose workers do use CUDA says so with
# `uses_cuda_in_workers = True` and gets `forkserver` (torch and the dataset's module preloaded
# into the fork server, so each worker starts warm), or `spawn` where there is no fork server.
# `fork` is set explicitly, so Python 3.14's forkserver default does not bring the slow start back.


def user_forkserver(f: WorkerFacts) -> Decision | None:
    if "multiprocessing_context" not in f.user_keys:
        return None
    context = f.settings["multiprocessing_context"]
    if start_method_name(context) != "forkserver":
        return None
    reason = "override; torch and the dataset's module preloaded in the fork server"
    return Decision("multiprocessing_context", context, reason)


def user_context(f: WorkerFacts) -> Decision | None:
    if "multiprocessing_context" not in f.user_keys:
        return None
    return Decision("multiprocessing_context", f.settings["multiprocessing_context"], "override")


def forkserver_for_cuda(f: WorkerFacts) -> Decision | None:
    # See NOTE [fork and CUDA]
    if not getattr(f.dataset, "uses_cuda_in_workers", False) or "forkserver" not in f.methods:
        return None
    reason = (
        "forkserver: the dataset sets uses_cuda_in_workers, and CUDA cannot be used in a "
        "forked child; torch and the dataset's module are preloaded so each worker starts "
        "from a warm fork server instead of importing torch"
    )
    return Decision("multiprocessing_context", "forkserver", reason)


def spawn_for_cuda(f: WorkerFacts) -> Decision | None:
    if not getattr(f.dataset, "uses_cuda_in_workers", False):
        return None
    reason = "spawn: the dataset sets uses_cuda_in_workers and forkserver is unavailable"
    return Decision("multiprocessing_context", "spawn", reason)


def fork_after_cuda(f: WorkerFacts) -> Decision | None:
    # See NOTE [fork and CUDA]
    if "fork" not in f.methods or not f.linux or not torch.cuda.is_initialized():
        return None
    reason = (
        "fork: workers start in milliseconds with the parent's imports (CUDA is initialised "
        "here; safe since workers do not use it); a dataset that uses CUDA in workers sets "
        "uses_cuda_in_workers = True"
    )
    return Decision("multiprocessing_context", "fork", reason)


def fork(f: WorkerFacts) -> Decision | None:
    # See NOTE [fork and CUDA]
    if "fork" not in f.methods or not f.linux:
        return None
    reason = (
        "fork: workers start in milliseconds with the parent's imports; a dataset that uses "
        "CUDA in workers sets uses_cuda_in_workers = True"
    )
    return Decision("multiprocessing_context", "fork", reason)


# First match: the user's context wins; no rule answers off Linux without CUDA in workers.
START_METHOD_RULES: tuple[Rule, ...] = (
    user_forkserver,
    user_context,
    forkserver_for_cuda,
    spawn_for_cuda,
    fork_after_cuda,
    fork,
)


def worker_init_first(f: WorkerFacts) -> Decision | None:
    # The OpenCV fork deadlock and identical NumPy draws across workers: `worker_init`, chained
    # before the user's own `worker_init_fn`.
    reason = "worker_init (OpenCV fork fix, 1 torch thread, seeded RNGs), then yours"
    return Decision("worker_init_fn", ChainedWorkerInit(f.settings.get("worker_init_fn")), reason)


def start_method(f: WorkerFacts) -> Decision | None:
    return decide(START_METHOD_RULES, f)


def file_system_sharing(f: WorkerFacts) -> Decision | None:
    # "received 0 items of ancdata" (pytorch#973); the switch is process-wide: torch has no
    # per-loader one.
    if f.nofile_limit >= LOW_NOFILE:
        return None
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        return None
    reason = (
        f"file_system: ulimit -n is {f.nofile_limit} (< {LOW_NOFILE}); file_descriptor "
        "sharing would run out of descriptors"
    )
    return Decision(SHARING_STRATEGY, "file_system", reason)


# Every rule that answers applies, in this order (worker processes only).
SAFETY_RULES: tuple[Rule, ...] = (worker_init_first, start_method, file_system_sharing)


def warn_copy_on_read(dataset, workers: int) -> None:
    """Large Python containers on a dataset grow every forked worker's memory as it reads them
    (reference counts write to every object's page: pytorch#13246)."""
    for owner, prefix in ((dataset, ""), (getattr(dataset, "dataset", None), "dataset.")):
        if not hasattr(owner, "__dict__"):
            continue
        for name, value in vars(owner).items():
            if isinstance(value, (list, dict, tuple)) and len(value) > COPY_ON_READ_ITEMS:
                warnings.warn(
                    f"{type(dataset).__name__}.{prefix}{name} is a Python {type(value).__name__} "
                    f"of {len(value):,} items: each of the {workers} forked workers copies the "
                    "pages it reads (reference counts write to them), so worker memory grows "
                    "through the epoch until it equals the parent's. Hold it in numpy arrays, or "
                    "PackedStrings (recipes.common.caches.packed_strings) for strings.",
                    LoaderWarning,
                    stacklevel=4,
                )


def preload_forkserver(dataset) -> None:
    """Imports done once in the fork server, inherited by every worker it forks."""
    modules = ["torch", "numpy"]
    module = type(dataset).__module__
    if module and module not in ("__main__", "builtins"):
        modules.append(module)
    multiprocessing.set_forkserver_preload(modules)
