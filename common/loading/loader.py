"""`make_loader`: a DataLoader built from a profile, with the known traps handled.

Use when: you would otherwise hand-tune `num_workers`, `pin_memory`, `prefetch_factor` and
`persistent_workers`. The returned object is a `torch.utils.data.DataLoader` (a
`StatefulLoader`, whose state resumes exactly mid-epoch); the chosen settings and the reason
for each are in `loader.recipe`.
Cost: `detect_resources()` (a few file reads) and, for `profile="auto"` on a map-style
dataset, one `dataset[0]` to measure a sample.
Adapt here: `_apply_safety_rules` holds every rule; overrides always win.
Trade-off: switching to the `file_system` sharing strategy is process-wide (torch offers no
per-loader switch); it is done only when `ulimit -n` is too low for `file_descriptor`.

Traps handled:
- `prefetch_factor` / `persistent_workers` with 0 workers make DataLoader raise: never passed.
- Pinning without CUDA only warns and wastes a thread: pinned only when CUDA is available.
- The start method stays `fork`, also after CUDA is initialised: forking is safe while the
  workers themselves never touch CUDA (PyTorch's own default relies on it), and `forkserver` or
  `spawn` re-import torch in every worker (a 15-54 s first batch on a 16-core GPU node) and
  crash scripts without an `if __name__ == "__main__":` guard. A dataset whose workers do use
  CUDA says so with `uses_cuda_in_workers = True` and gets `forkserver`, with torch and the
  dataset's module preloaded into the fork server.
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
  common/loading/epoch_read_ahead.py, common/loading/isolated_loader.py,
  common/loading/loader_path.py, common/loading/loop_probe.py, common/loading/stateful_loader.py,
  common/loading/thread_loader.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_counting.py,
  common/resume/loader_passes.py, common/resume/loader_state.py, common/resume/order_sources.py,
  common/resume/pass_sampler.py, common/resume/state_keys.py, common/resume/state_records.py,
  common/sampling/elastic_sampler.py, common/sampling/sharding.py, common/sizing/profiles.py,
  common/sizing/resources.py, common/sizing/sizing.py, common/sizing/tune_store.py,
  common/workers/held_descriptors.py, common/workers/process_lifetime.py,
  common/workers/start_watch.py, common/workers/worker.py.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from recipes.common.loading.loader_path import THREAD_KEYS, THREAD_ONLY, choose_path, isolate
from recipes.common.loading.stateful_loader import StatefulLoader
from recipes.common.loading.thread_loader import ThreadLoader
from recipes.common.sizing.profiles import LoaderRecipe, profile_settings
from recipes.common.sizing.resources import Resources, detect_resources
from recipes.common.workers.worker import ChainedWorkerInit

# Below this soft `ulimit -n`, DataLoader's default `file_descriptor` sharing strategy runs
# out of descriptors once a few hundred shared tensors are alive.
LOW_NOFILE = 4096
# Python containers larger than this on a dataset cost forked workers real memory (copy-on-read).
COPY_ON_READ_ITEMS = 100_000


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
            `loader.recipe.reasons["path"]` says why.
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
    chosen, why = choose_path(dataset, path, overrides)
    res = resources if resources is not None else detect_resources()
    preferred = getattr(dataset, "recommended_profile", None)
    if profile == "auto" and preferred is not None:
        recipe = profile_settings(preferred, res)
        recipe.reasons["profile"] = (
            f"auto: {type(dataset).__name__} recommends the {preferred} profile"
        )
    else:
        sample_bytes = _probe_sample_bytes(dataset) if profile == "auto" else None
        recipe = profile_settings(profile, res, sample_bytes=sample_bytes)
    settings = dict(recipe.settings)
    reasons = dict(recipe.reasons)
    if batch_size is not None:
        settings["batch_size"] = batch_size
        reasons["batch_size"] = "given"
    record = (
        _apply_tuned(dataset, settings, reasons, res, batch_sampler="batch_sampler" in overrides)
        if tuned and not {"num_workers", "prefetch_factor"} & set(overrides)
        else None
    )
    for key, value in overrides.items():
        settings[key] = value
        reasons[key] = "override"
    _split_ranks(dataset, settings, reasons, distributed)
    extras = {key: settings.pop(key) for key in THREAD_ONLY if key in overrides}
    measured = None  # the path autotune measured, when "auto" takes it
    if chosen == "threads" and path == "auto":
        from recipes.common.loading.loader_path import from_tuned

        chosen, why = (measured := from_tuned(record, extras)) or isolate(
            dataset, settings, res.cpus, why
        )
    from recipes.common.loading.loader_path import child_arguments

    child_arguments(
        path, chosen, why, overrides, settings, reasons, extras
    )  # the child's: timeout, niceness
    if chosen in ("threads", "isolated"):
        unknown = sorted(
            set(overrides) - set(THREAD_KEYS) - set(THREAD_ONLY) - set(extras) - {"niceness"}
        )
        if unknown:
            raise TypeError(
                "make_loader() got arguments neither a ThreadLoader nor a DataLoader takes: "
                f"{unknown}."
            )
        return _thread_loader(
            dataset,
            recipe.profile,
            settings,
            reasons,
            res,
            why,
            extras,
            chosen,
            adaptive=path == "auto" and measured is None,
        )
    if extras:
        raise TypeError(
            f"{sorted(extras)} configure the thread path (ThreadLoader), but this loader has "
            f"worker processes ({why}); drop them, or pass path='threads'."
        )
    _apply_safety_rules(dataset, settings, reasons, res, user_keys=set(overrides))
    if settings.get("shuffle") and not isinstance(dataset, IterableDataset):
        reasons["sampler"] = (
            "RandomSampler with a generator of the loader's own (seeded from `generator`, else "
            "torch's RNG): state_dict() saves its state where each epoch's order is drawn"
        )
    loader = StatefulLoader(dataset, **settings)
    reasons["path"] = why
    loader.recipe = LoaderRecipe(recipe.profile, _printable(settings), reasons)
    return loader


def _split_ranks(
    dataset, settings: dict[str, Any], reasons: dict[str, str], distributed: bool | None
) -> None:
    """Under an initialised process group of several ranks (`distributed` None or True), a
    map-style dataset without a sampler of the user's gets an `ElasticDistributedSampler`."""
    import torch.distributed as dist

    from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler

    initialised = dist.is_available() and dist.is_initialized()
    if distributed and not initialised:
        raise ValueError(
            "make_loader(distributed=True) needs an initialised torch.distributed process group "
            "(dist.init_process_group); leave `distributed` at None to split the ranks when there "
            "is one."
        )
    world = dist.get_world_size() if initialised else 1
    if distributed is False or world < 2:
        if initialised and world > 1 and not isinstance(dataset, IterableDataset):
            reasons["sampler"] = (
                f"every rank reads the whole dataset: distributed=False ({world} ranks)"
            )
        return
    if isinstance(dataset, IterableDataset):
        split = getattr(dataset, "world_size", None)
        reasons["ranks"] = (
            f"{type(dataset).__name__} splits itself over its {split} ranks"
            if split is not None
            else f"{type(dataset).__name__} is iterable and says no world_size: it must split the "
            f"{world} ranks itself (every rank reads whatever it yields)"
        )
        return
    for key in ("batch_sampler", "sampler"):
        if settings.get(key) is not None:
            mine = settings[key]
            inner = getattr(mine, "sampler", mine)
            ranks = getattr(mine, "num_replicas", getattr(inner, "num_replicas", None))
            reasons[key] = (
                f"given ({type(mine).__name__}"
                + (
                    f", split over {ranks} ranks)"
                    if ranks is not None
                    else f"; it says no num_replicas: make sure it splits the {world} ranks)"
                )
                + (
                    "; a DistributedSampler's state refuses another number of ranks on resume, an "
                    "ElasticDistributedSampler's does not"
                    if isinstance(inner, DistributedSampler)
                    and not isinstance(inner, ElasticDistributedSampler)
                    else ""
                )
            )
            return
    shuffle = bool(settings.pop("shuffle", False))
    drop_last = bool(settings.get("drop_last", False))
    settings["sampler"] = ElasticDistributedSampler(
        dataset,
        num_replicas=world,
        rank=dist.get_rank(),
        shuffle=shuffle,
        seed=0,
        drop_last=drop_last,
    )
    # seed 0 on every rank, as DistributedSampler's: a `generator=` is often seeded per rank (for
    # the batches' own draws), and ranks whose orders differ would read some samples twice and miss
    # others
    reasons["sampler"] = (
        f"ElasticDistributedSampler: {world} ranks of an initialised process group, each its "
        f"share (shuffle={shuffle}, seed 0 on every rank as DistributedSampler's; another order: "
        f"sampler=ElasticDistributedSampler(dataset, seed=...); drop_last={drop_last}: "
        + (
            "at most R - 1 samples dropped, and each rank's last partial batch"
            if drop_last
            else "padded with at most R - 1 repeats"
        )
        + " per epoch for equal steps); the state resumes on any number of ranks; the next epoch "
        "starts by itself when the loop does not call loader.sampler.set_epoch"
    )
    reasons.pop("shuffle", None)


def _thread_loader(
    dataset,
    profile: str,
    settings: dict[str, Any],
    reasons: dict[str, str],
    res: Resources,
    why: str,
    extras: dict[str, Any],
    path: str = "threads",
    adaptive: bool = True,
) -> ThreadLoader:
    """The thread path, in this process or isolated in a child: the profile's batch settings,
    one thread per CPU of this rank (or the given `threads`, `prefetch`, `seed`)."""
    from recipes.common.loading.isolated_loader import IsolatedLoader
    from recipes.common.sizing.sizing import local_world_size_from_env

    kwargs = {key: settings[key] for key in THREAD_KEYS if key in settings}
    if "batch_sampler" in kwargs:
        kwargs.pop("batch_size", None)
    threads = extras.pop("threads", None)
    if threads is None:  # a given 0 or less is refused by the loader, not replaced
        threads = max(1, res.cpus // local_world_size_from_env())
    if (
        path == "isolated"
    ):  # chosen by "auto" by rule: measured against the loop (IsolatedLoader's probe)
        loader = IsolatedLoader(dataset, threads=threads, adaptive=adaptive, **extras, **kwargs)
    else:
        loader = ThreadLoader(dataset, threads=threads, **extras, **kwargs)
    kept = {key: reasons[key] for key in (*THREAD_KEYS, "profile", "niceness") if key in reasons}
    kept.update({key: "override" for key in extras})
    kept.update(
        path=why,
        threads=f"{threads}: " + ("override" if "threads" in reasons else "the CPUs of this rank"),
        sampler=reasons.get("sampler", "the DataLoader default")
        if kwargs.get("shuffle")
        else kept.get("sampler", "in order"),
    )
    where = "of one child process (IsolatedLoader)" if path == "isolated" else "of this process"
    loader.recipe = LoaderRecipe(
        profile,
        _printable({**kwargs, **extras, "num_workers": 0, "path": path, "threads": threads}),
        {**kept, "num_workers": f"0: batches are read by threads {where}"},
    )
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
    from recipes.common.sizing.tune_store import load_tuned

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


def _validate(batch_size: int | None, overrides: Mapping[str, Any]) -> None:
    for name, value in (("batch_size", batch_size), ("num_workers", overrides.get("num_workers"))):
        if value is None:
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"`{name}` must be an integer, but is {value!r} instead.")
        if value < (1 if name == "batch_size" else 0):
            kind = "positive" if name == "batch_size" else "non-negative"
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
    if "batch_sampler" in settings:
        # DataLoader's batch_sampler is exclusive with batch_size, shuffle, sampler, drop_last.
        settings.pop("batch_size", None)
        reasons.pop("batch_size", None)
    workers = settings.get("num_workers", 0)
    if workers == 0:
        for key in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout"):
            if settings.pop(key, None) is not None and key in user_keys:
                reasons[key] = "dropped: DataLoader rejects it with 0 workers"
        return
    _warn_copy_on_read(dataset, workers)
    settings["worker_init_fn"] = ChainedWorkerInit(settings.get("worker_init_fn"))
    reasons["worker_init_fn"] = (
        "worker_init (OpenCV fork fix, 1 torch thread, seeded RNGs), then yours"
    )
    _choose_start_method(dataset, settings, reasons, user_keys)
    if (
        res.nofile_limit < LOW_NOFILE
        and torch.multiprocessing.get_sharing_strategy() != "file_system"
    ):
        torch.multiprocessing.set_sharing_strategy("file_system")
        reasons["sharing_strategy"] = (
            f"file_system: ulimit -n is {res.nofile_limit} (< {LOW_NOFILE}); file_descriptor "
            "sharing would run out of descriptors"
        )


def _warn_copy_on_read(dataset, workers: int) -> None:
    """Large Python containers on a dataset grow every forked worker's memory as it reads them
    (reference counts write to every object's page: pytorch#13246)."""
    import warnings

    from recipes.common.loader_warning import LoaderWarning

    for owner, prefix in ((dataset, ""), (getattr(dataset, "dataset", None), "dataset.")):
        for name, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
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


def _choose_start_method(
    dataset, settings: dict[str, Any], reasons: dict[str, str], user_keys: set[str]
) -> None:
    """`fork` unless the dataset's workers use CUDA or the user chose otherwise (see the module
    doc)."""
    methods = multiprocessing.get_all_start_methods()
    if "multiprocessing_context" in user_keys:
        context = settings["multiprocessing_context"]
        name = context if isinstance(context, str) else context.get_start_method()
        if name == "forkserver":
            _preload_forkserver(dataset)
            reasons["multiprocessing_context"] = (
                "override; torch and the dataset's module preloaded in the fork server"
            )
        return
    if getattr(dataset, "uses_cuda_in_workers", False):
        if "forkserver" in methods:
            _preload_forkserver(dataset)
            settings["multiprocessing_context"] = "forkserver"
            reasons["multiprocessing_context"] = (
                "forkserver: the dataset sets uses_cuda_in_workers, and CUDA cannot be used in a "
                "forked child; torch and the dataset's module are preloaded so each worker starts "
                "from a warm fork server instead of importing torch"
            )
        else:
            settings["multiprocessing_context"] = "spawn"
            reasons["multiprocessing_context"] = (
                "spawn: the dataset sets uses_cuda_in_workers and forkserver is unavailable"
            )
        return
    if "fork" in methods and sys.platform.startswith("linux"):
        # Explicit, so Python 3.14's forkserver default does not bring back the slow start.
        settings["multiprocessing_context"] = "fork"
        cuda = (
            " (CUDA is initialised here; safe since workers do not use it)"
            if torch.cuda.is_initialized()
            else ""
        )
        reasons["multiprocessing_context"] = (
            f"fork: workers start in milliseconds with the parent's imports{cuda}; a dataset "
            "that uses CUDA in workers sets uses_cuda_in_workers = True"
        )


def _preload_forkserver(dataset) -> None:
    """Imports done once in the fork server, inherited by every worker it forks."""
    modules = ["torch", "numpy"]
    module = type(dataset).__module__
    if module and module not in ("__main__", "builtins"):
        modules.append(module)
    multiprocessing.set_forkserver_preload(modules)


def _printable(settings: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in settings.items():
        if isinstance(value, ChainedWorkerInit):
            user = value.user_fn
            value = "worker_init" + (f" + {getattr(user, '__name__', repr(user))}" if user else "")
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
