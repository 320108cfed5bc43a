"""`make_loader`: a DataLoader built from a profile, with the known traps handled.

Use when: you would otherwise hand-tune `num_workers`, `pin_memory`, `prefetch_factor` and
`persistent_workers`. The returned object is a `torch.utils.data.DataLoader` (a
`StatefulLoader`, whose state resumes exactly mid-epoch); the chosen settings and the reason
for each are in `loader.recipe`.
Cost: `detect_resources()` (a few file reads) and, for `profile="auto"` on a map-style
dataset, one `dataset[0]` to measure a sample.
Adapt here: the rules, in tables run in order: `loader_path.py` (`PATH_RULES`,
`THREAD_PATH_RULES`), `loader_rules.py` (`SAMPLER_RULES`, `ORDER_RULES`) and `worker_rules.py`
(`START_METHOD_RULES`, `SAFETY_RULES`); this module only builds the loader they describe.
Overrides always win.
Trade-off: switching to the `file_system` sharing strategy is process-wide (torch offers no
per-loader switch); it is done only when `ulimit -n` is too low for `file_descriptor`.

Traps handled:
- `prefetch_factor` / `persistent_workers` with 0 workers make DataLoader raise: never passed.
- Pinning without CUDA only warns and wastes a thread: pinned only when CUDA is available.
- The start method stays `fork`, also after CUDA is initialised; a dataset whose workers do
  use CUDA says so with `uses_cuda_in_workers = True` and gets `forkserver`, with torch and the
  dataset's module preloaded into the fork server. See NOTE [fork and CUDA] (worker_rules.py).
- `file_descriptor` sharing runs out of descriptors ("received 0 items of ancdata", pytorch#973)
  under a low `ulimit -n`: `file_system` instead.
- Copy-on-read growth: a dataset holding Python lists, dicts or tuples of more than 100k items
  gets a `LoaderWarning` naming the attribute (`PackedStrings` or numpy instead).
- The OpenCV fork deadlock and identical NumPy draws across workers: `worker_init`, chained
  before the user's own `worker_init_fn`.
- A worker stuck in its fork (CPython gh-112275, Python < 3.12): replaced, no batch lost
  (`StartWatch`).
- Under an initialised process group, a map-style dataset read whole by every rank (each rank trains
  on everything, or the user's `DistributedSampler` refuses to resume on another world size): an
  `ElasticDistributedSampler` of its own (`distributed=False` opts out; the user's sampler wins).
Copy with: common/caches/cache_files.py, common/loader_warning.py, common/loading/batch_ring.py,
  common/loading/epoch_read_ahead.py, common/loading/isolated/child.py,
  common/loading/isolated/protocol.py, common/loading/isolated_loader.py,
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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from recipes.common.loading.isolated_loader import IsolatedLoader
from recipes.common.loading.loader_path import (
    THREAD_KEYS,
    THREAD_ONLY,
    THREAD_PATH_RULES,
    Decision,
    ThreadPathFacts,
    autotuned_path,
    child_arguments,
    choose_path,
    decide,
)
from recipes.common.loading.loader_rules import (
    ORDER_RULES,
    SAMPLER_RULES,
    OrderFacts,
    rank_facts,
)
from recipes.common.loading.stateful_loader import StatefulLoader
from recipes.common.loading.thread_loader import ThreadLoader
from recipes.common.loading.worker_rules import (
    COPY_ON_READ_ITEMS,
    LOW_NOFILE,
    SAFETY_RULES,
    SHARING_STRATEGY,
    WORKER_ARGUMENTS,
    ZERO_WORKERS_DROPPED,
    preload_forkserver,
    start_method_name,
    warn_copy_on_read,
    worker_facts,
)
from recipes.common.sizing.profiles import LoaderRecipe, profile_settings
from recipes.common.sizing.resources import Resources, detect_resources
from recipes.common.sizing.sizing import local_world_size_from_env
from recipes.common.sizing.tune_store import load_tuned
from recipes.common.workers.worker import ChainedWorkerInit

__all__ = ["COPY_ON_READ_ITEMS", "LOW_NOFILE", "make_loader", "sample_nbytes"]


def make_loader(
    dataset,
    *,
    profile: str = "auto",
    batch_size: int | None = None,
    resources: Resources | None = None,
    tuned: bool = True,
    path: str = "auto",
    distributed: bool | None = None,
    **overrides: Any,
) -> DataLoader:
    """A DataLoader with the settings of `profile`, corrected for this machine.

    Args:
        dataset: a map-style or iterable Dataset.
        profile: `debug`, `production`, `memory`, `throughput`, `text` or `auto`: the
            dataset's `recommended_profile` attribute when it has one (`TokenCache`: text),
            else production, or memory when the in-flight estimate for a probed sample
            exceeds the budget.
        batch_size: samples per batch; the profile's default when None. Not passed when
            `batch_sampler` is given.
        resources: a `Resources` snapshot; `detect_resources()` when None.
        tuned: use the path, workers and prefetch factor that `autotune` / `recipes tune` stored for
            this dataset, batch size and machine, when there are such (overrides still win).
        path: "auto": a `ThreadLoader` (threads of this process, no workers) when the dataset's
            batches are made by code that releases the GIL (`ThreadBatched.thread_batches()`: a
            memory-speed cache, or `ImageFolderFast`'s OpenCV decoding) and no worker argument is
            given, in a child process (`IsolatedLoader`) for epochs of 16 batches or more, else
            worker processes; "isolated", "threads" or "workers" to choose.
            `loader.recipe.reasons["path"]` says why (NOTE [the GIL and the thread paths]).
        distributed: split a map-style dataset over the ranks of the initialised process
            group with an `ElasticDistributedSampler` (`shuffle`, `drop_last`, seed 0 on every
            rank as `DistributedSampler`'s, never `generator`'s, which may differ per rank; a
            state resumes on any number of ranks). None (the default): when a group of more than one
            rank is initialised and no `sampler` or `batch_sampler` is given (the user's wins);
            False: every rank reads the whole dataset (an evaluation on rank 0). An iterable dataset
            splits itself (`ShardedIterableDataset` reads the ranks). `loader.recipe.reasons
            ["sampler"]` says which sampler and why.
        **overrides: any DataLoader keyword argument, winning over the profile; the thread paths'
            `threads`, `prefetch`, `seed`; the isolated path's `niceness`
            (`loader_path.child_arguments`).

    Returns:
        A `StatefulLoader` (a `ThreadLoader` on the thread path: a `DataLoader` whose
        `state_dict()`/`load_state_dict()` resume at the first batch the loop has not received, in
        any epoch: `loader_contract.py`) with `loader.recipe`, a `LoaderRecipe` holding the final
        settings and the reason for each.

    Raises:
        ValueError: for an unknown profile or invalid sizes.

    Example:
        >>> loader = make_loader(dataset, profile="production", shuffle=True)
        >>> print(loader.recipe)
    """
    _validate(batch_size, overrides)
    chosen = choose_path(dataset, path, overrides)
    res = resources
    if res is None:
        res = detect_resources()
    recipe = _profile_recipe(dataset, profile, res)
    settings = dict(recipe.settings)
    reasons = dict(recipe.reasons)
    if batch_size is not None:
        settings["batch_size"] = batch_size
        reasons["batch_size"] = "given"
    record = None
    if tuned and not {"num_workers", "prefetch_factor"} & set(overrides):
        batch_sampler = "batch_sampler" in overrides
        record = _apply_tuned(dataset, settings, reasons, res, batch_sampler=batch_sampler)
    for key, value in overrides.items():
        settings[key] = value
        reasons[key] = "override"
    _split_ranks(dataset, settings, reasons, distributed)
    extras = {key: settings.pop(key) for key in THREAD_ONLY if key in overrides}
    if chosen.setting == "threads" and path == "auto":
        facts = ThreadPathFacts(chosen.reason, dataset, settings, res.cpus, record, extras)
        chosen = decide(THREAD_PATH_RULES, facts)
    child_arguments(
        path, chosen, overrides, settings, reasons, extras
    )  # the child's: timeout, niceness
    if chosen.setting in ("threads", "isolated"):
        unknown = sorted(
            set(overrides) - set(THREAD_KEYS) - set(THREAD_ONLY) - set(extras) - {"niceness"}
        )
        if unknown:
            raise TypeError(
                "make_loader() got arguments neither a ThreadLoader nor a DataLoader takes: "
                f"{unknown}."
            )
        # adaptive: chosen by "auto" by rule, measured against the loop (IsolatedLoader's probe)
        adaptive = path == "auto" and chosen.rule != autotuned_path.__name__
        return _thread_loader(
            dataset, recipe.profile, settings, reasons, res, chosen, extras, adaptive
        )
    if extras:
        raise TypeError(
            f"{sorted(extras)} configure the thread path (ThreadLoader), but this loader has "
            f"worker processes ({chosen.reason}); drop them, or pass path='threads'."
        )
    _apply_safety_rules(dataset, settings, reasons, res, user_keys=set(overrides))
    order = _order(dataset, settings, reasons, threads=False)
    if order is not None:
        reasons["sampler"] = order.reason
    loader = StatefulLoader(dataset, **settings)
    reasons["path"] = chosen.reason
    loader.recipe = LoaderRecipe(recipe.profile, _printable(settings), reasons)
    return loader


def _profile_recipe(dataset, profile: str, res: Resources) -> LoaderRecipe:
    """The profile's settings: the dataset's `recommended_profile` under "auto" when it has one,
    else the profile (under "auto", sized by one probed sample)."""
    preferred = getattr(dataset, "recommended_profile", None)
    if profile == "auto" and preferred is not None:
        recipe = profile_settings(preferred, res)
        reason = f"auto: {type(dataset).__name__} recommends the {preferred} profile"
        recipe.reasons["profile"] = reason
        return recipe
    sample_bytes = None
    if profile == "auto":
        sample_bytes = _probe_sample_bytes(dataset)
    return profile_settings(profile, res, sample_bytes=sample_bytes)


def _split_ranks(
    dataset, settings: dict[str, Any], reasons: dict[str, str], distributed: bool | None
) -> None:
    """Runs `SAMPLER_RULES`: under an initialised process group of several ranks (`distributed`
    None or True), a map-style dataset without a sampler of the user's gets an
    `ElasticDistributedSampler`."""
    decision = decide(SAMPLER_RULES, rank_facts(dataset, settings, distributed))
    if decision is None:
        return
    reasons[decision.key] = decision.reason
    if decision.setting is not None:  # the sampler chosen takes the place of `shuffle`
        settings[decision.key] = decision.setting
        settings.pop("shuffle", None)
        reasons.pop("shuffle", None)


def _order(
    dataset, settings: dict[str, Any], reasons: dict[str, str], *, threads: bool
) -> Decision | None:
    """Runs `ORDER_RULES`: the sampler's reason once the path is known (None: nothing to say)."""
    shuffle = bool(settings.get("shuffle"))
    iterable = isinstance(dataset, IterableDataset)
    facts = OrderFacts(threads, shuffle, iterable, reasons.get("sampler"))
    return decide(ORDER_RULES, facts)


# How the thread path's batches are read, by path.
THREADS_OF = {
    "isolated": "of one child process (IsolatedLoader)",
    "threads": "of this process",
}


def _thread_loader(
    dataset,
    profile: str,
    settings: dict[str, Any],
    reasons: dict[str, str],
    res: Resources,
    chosen: Decision,
    extras: dict[str, Any],
    adaptive: bool,
) -> ThreadLoader:
    """The thread path, in this process or isolated in a child: the profile's batch settings,
    one thread per CPU of this rank (or the given `threads`, `prefetch`, `seed`)."""
    path = chosen.setting
    kwargs = {key: settings[key] for key in THREAD_KEYS if key in settings}
    if "batch_sampler" in kwargs:
        kwargs.pop("batch_size", None)
    threads = extras.pop("threads", None)
    if threads is None:  # a given 0 or less is refused by the loader, not replaced
        threads = max(1, res.cpus // local_world_size_from_env())
    threads_why = f"{threads}: the CPUs of this rank"
    if "threads" in reasons:
        threads_why = f"{threads}: override"
    if path == "isolated":
        loader = IsolatedLoader(dataset, threads=threads, adaptive=adaptive, **extras, **kwargs)
    else:
        loader = ThreadLoader(dataset, threads=threads, **extras, **kwargs)
    kept = {key: reasons[key] for key in (*THREAD_KEYS, "profile", "niceness") if key in reasons}
    kept.update({key: "override" for key in extras})
    order = _order(dataset, settings, reasons, threads=True)
    kept.update(path=chosen.reason, threads=threads_why, sampler=order.reason)
    kept["num_workers"] = f"0: batches are read by threads {THREADS_OF[path]}"
    printable = {**kwargs, **extras, "num_workers": 0, "path": path, "threads": threads}
    loader.recipe = LoaderRecipe(profile, _printable(printable), kept)
    return loader


def _apply_tuned(
    dataset,
    settings: dict[str, Any],
    reasons: dict[str, str],
    res: Resources,
    *,
    batch_sampler: bool,
) -> dict[str, Any] | None:
    """Applies the stored worker settings; returns their record (`loader_path.from_tuned`), or
    None."""
    record = load_tuned(dataset, res)
    if record is None:
        return None
    stored = record["settings"]
    if not batch_sampler and stored.get("batch_size") != settings.get("batch_size"):
        return None  # tuned for another batch size: the figures do not transfer
    why = (
        f"autotuned {record.get('when', '')}: {record.get('samples_per_s', 0):,.0f} samples/s "
        "measured on this machine (recipes tune; tuned=False ignores it)"
    )
    for key in ("num_workers", "prefetch_factor", "persistent_workers"):
        if key in stored:
            settings[key] = stored[key]
            reasons[key] = why
    if stored.get("num_workers") == 0:
        for key in ("prefetch_factor", "persistent_workers"):
            settings.pop(key, None)
            reasons.pop(key, None)
    return record


# The least value of each size `make_loader` checks, and its name in the error.
_LEAST = {"batch_size": (1, "positive"), "num_workers": (0, "non-negative")}


def _validate(batch_size: int | None, overrides: Mapping[str, Any]) -> None:
    for name, value in (("batch_size", batch_size), ("num_workers", overrides.get("num_workers"))):
        if value is None:
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"`{name}` must be an integer, but is {value!r} instead.")
        least, kind = _LEAST[name]
        if value < least:
            raise ValueError(f"`{name}` must be {kind}, but is {value!r} instead.")
    prefetch = overrides.get("prefetch_factor")
    if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
        raise ValueError(
            f"`prefetch_factor` must be a positive integer, but is {prefetch!r} instead."
        )


def _apply_safety_rules(
    dataset,
    settings: dict[str, Any],
    reasons: dict[str, str],
    res: Resources,
    *,
    user_keys: set[str],
) -> None:
    """DataLoader's exclusions, then `SAFETY_RULES` for worker processes."""
    if "batch_sampler" in settings:
        # DataLoader's batch_sampler is exclusive with batch_size, shuffle, sampler, drop_last.
        settings.pop("batch_size", None)
        reasons.pop("batch_size", None)
    workers = settings.get("num_workers", 0)
    if workers == 0:
        for key in WORKER_ARGUMENTS:
            if settings.pop(key, None) is not None and key in user_keys:
                reasons[key] = ZERO_WORKERS_DROPPED
        return
    warn_copy_on_read(dataset, workers)
    facts = worker_facts(dataset, settings, user_keys, res.nofile_limit)
    for rule in SAFETY_RULES:
        decision = rule(facts)
        if decision is None:
            continue
        reasons[decision.key] = decision.reason
        if decision.key == SHARING_STRATEGY:  # process-wide: torch has no per-loader switch
            torch.multiprocessing.set_sharing_strategy(decision.setting)
            continue
        settings[decision.key] = decision.setting
        if (
            decision.key == "multiprocessing_context"
            and start_method_name(decision.setting) == "forkserver"
        ):
            preload_forkserver(dataset)


def _printable(settings: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in settings.items():
        if isinstance(value, ChainedWorkerInit):
            user = value.user_fn
            value = "worker_init"
            if user:
                value += f" + {getattr(user, '__name__', repr(user))}"
        elif callable(value) or not isinstance(value, (int, float, str, bool, type(None))):
            value = getattr(value, "__name__", type(value).__name__)
        out[key] = value
    return out


def _probe_sample_bytes(dataset) -> int | None:
    """Bytes of `dataset[0]` (tensors, arrays, bytes, numbers; nested), None when unknowable."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        if len(dataset) == 0:
            return None
    except TypeError:
        return None
    return sample_nbytes(dataset[0])


def sample_nbytes(obj) -> int:
    """Bytes a sample occupies once collated (recursing into dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.numel()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, Mapping):
        return sum(sample_nbytes(v) for v in obj.values())
    if isinstance(obj, Sequence):
        return sum(sample_nbytes(v) for v in obj)
    return 8  # a Python scalar collates to an 8-byte tensor element
