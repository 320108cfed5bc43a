"""The loader's resume: what a `StatefulLoader` state holds beside its passes (the plan, the
batch seed, the checks on load), and how an iterable dataset's epoch goes on from a saved
state.

Use when: you read what `StatefulLoader.state_dict()` saves beside its passes
(`loader_passes.py`) and what `load_state_dict()` refuses, or how an iterable dataset's pass
resumes: by the dataset's own `resume_after` (on its old or a new shape), by the dataset
copies' own states (`dataset_state.py`), or by reading the epoch's first batches again.
Cost: a resumed pass of an iterable dataset runs one epoch on its own `DataLoader` (fresh
workers) over the dataset's rest, then the loader's own again; a dataset without
`resume_after` is read from the epoch's start, its first batches dropped.
Adapt here: nothing; the contract a dataset implements to be resumed is `loader_contract.py`.
Trade-off: the loader lends this module two ways of starting an epoch on itself
(`EpochStarts`), so that what its iterator and workers are stays with the loader.
Copy with: common/loader_warning.py, common/resume/batch_seeds.py, common/resume/dataset_state.py,
  common/resume/elastic_rest.py, common/resume/loader_contract.py, common/resume/loader_passes.py,
  common/resume/loader_state.py, common/resume/order_sources.py, common/resume/state_keys.py,
  common/resume/state_records.py.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, IterableDataset

import recipes.common.resume.state_keys as keys
from recipes.common.loader_warning import LoaderWarning
from recipes.common.resume.dataset_state import Carried, may_resume_itself
from recipes.common.resume.loader_contract import ResumableIterable
from recipes.common.resume.loader_passes import Pass
from recipes.common.resume.loader_state import differences, plan_settings


class EpochStarts(NamedTuple):
    """The two ways a resume starts an epoch on the loader itself.

    `plain()`: DataLoader's own iterator over one epoch (no counting, no resume).
    `loading_states(states, first_worker)`: an iterator on fresh workers, each of which loads
    its dataset copy's state from `states` first; its round-robin begins at `first_worker`.
    """

    plain: Callable[[], Iterator]
    loading_states: Callable[[dict, int], Iterator]


def loader_plan(loader: DataLoader) -> dict[str, Any]:
    """The settings that decide which samples each batch holds (checked on load)."""
    plan: dict[str, Any] = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if isinstance(loader.dataset, IterableDataset):
        plan["dataset"] = plan_settings(loader.dataset)
        return plan
    plan["num_samples"] = len(loader.dataset)
    if loader.batch_size is None and loader.batch_sampler is not None:  # the user's batch sampler
        plan["batch_sampler"] = plan_settings(loader.batch_sampler)
    else:
        plan["sampler"] = plan_settings(loader.sampler)
    return plan


def check_loadable(state: Any, loader: DataLoader) -> None:
    """Raises ValueError unless `state` is a loader state of this version saved under
    `loader`'s plan (computed only once the version is checked: a state of another version
    gets the version's error, whatever the loader's plan would raise)."""
    if (
        not isinstance(state, dict)
        or state.get(keys.VERSION) != keys.STATE_VERSION
        or keys.BATCHES_YIELDED not in state
    ):
        older = ""
        if isinstance(state, dict) and state.get(keys.VERSION) == 1:
            older = (
                "; version 1 states (recipes 0.1) resumed exactly only in a first epoch "
                "without persistent workers: resume from a checkpoint saved by this version"
            )
        raise ValueError(
            f"not a StatefulLoader state (version {keys.STATE_VERSION}): {state!r:.200}" + older
        )
    diff = differences(state.get(keys.PLAN) or {}, loader_plan(loader))
    if diff:
        raise ValueError(
            "This loader state was saved under other settings than this loader's, and they "
            "decide which samples each batch holds: "
            + "; ".join(diff)
            + ". Build the loader as the run "
            "that saved it did."
        )


def resumes_iterable(current: Pass) -> bool:
    """Whether an iterable dataset's pass goes on from a saved state (else DataLoader's own)."""
    resumed = current.resumed or {}
    return bool(
        current.skip
        or resumed.get(keys.REPLAYED)
        or resumed.get(keys.DATASET_STATES) is not None
        or current.reshaped is not None
    )


def resumed_iterable(loader: DataLoader, current: Pass, starts: EpochStarts):
    """An iterator over the rest of an iterable dataset's epoch, after `current.skip` batches."""
    dataset = loader.dataset
    state = current.resumed or {}
    states = state.get(keys.DATASET_STATES)
    if states is not None and may_resume_itself(dataset):
        saved = int(state.get(keys.DATASET_WORKERS, current.workers))
        if saved != loader.num_workers:
            raise ValueError(
                f"This state holds the own states of {type(dataset).__name__}'s copies in {saved} "
                f"worker(s) (each copy's share of the data); this loader has {loader.num_workers}. "
                f"Resume with num_workers={saved}, or from a state saved by a loader without a "
                "dataset state."
            )
        return _resumed_by_dataset(loader, starts, states, int(state.get(keys.NEXT_WORKER, 0)))
    if not isinstance(dataset, ResumableIterable):
        return _read_again(loader, current, starts)
    if current.reshaped is not None:  # an elastic resume: the epoch's rest dealt over this shape
        return _reshaped(loader, current)
    world = state.get(keys.WORLD_SIZE)
    if world is not None and world != dataset.world_size:  # other ranks: replay their rests here
        return _other_ranks(loader, current, world)
    before = current.workers
    if before != loader.num_workers:  # the epoch began with other workers: its order in-process
        rest = dataset.resume_after(
            current.skip,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            num_workers=before,
            interleave=True,
        )
        return _in_process(loader, rest)
    rest = dataset.resume_after(
        current.skip,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
    )
    return _fresh_workers(loader, rest)


def _read_again(loader: DataLoader, current: Pass, starts: EpochStarts):
    """A dataset with no `resume_after`: the epoch's first batches read again and dropped."""
    dataset = loader.dataset
    skip = current.skip
    state = current.resumed or {}
    if current.workers != max(loader.num_workers, 0) and state.get(keys.NUM_WORKERS) is not None:
        raise ValueError(
            f"{type(dataset).__name__} has no resume_after(): it resumes by reading the "
            f"epoch's first {skip} batches again, which only gives the same batches with the "
            f"same number of workers (saved with {current.workers}, this loader has "
            f"{loader.num_workers}). Resume with num_workers={current.workers}, or from a "
            "state saved at an epoch's end."
        )
    warnings.warn(
        f"{type(dataset).__name__} has no resume_after(); reading and discarding the first "
        f"{skip} batches of the epoch to resume.",
        LoaderWarning,
        stacklevel=4,
    )
    return _dropped(starts.plain(), skip)


def _reshaped(loader: DataLoader, current: Pass):
    """An elastic resume: the epoch's rest dealt over this loader's ranks and workers."""
    before = current.workers
    rest = loader.dataset.resume_after(
        current.skip,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        num_workers=before,
        interleave=before != loader.num_workers,
        reshaped=current.reshaped,
    )
    if before != loader.num_workers:  # within the rest, another worker count: its old order here
        return _in_process(loader, rest)
    return _fresh_workers(loader, rest)


def _other_ranks(loader: DataLoader, current: Pass, world: int):
    """A state saved on `world` ranks resumed on another count: their rests replayed here."""
    dataset = loader.dataset
    state = current.resumed or {}
    replay = state.get(keys.REPLAY_WORLD)
    if state.get(keys.REPLAYED) and replay != dataset.world_size:
        raise ValueError(
            f"This state was saved while {replay} rank(s) replayed the rest of an epoch begun "
            f"on {world}; resume it on {replay} rank(s), or from a state saved in another "
            "epoch."
        )
    rest = dataset.resume_after(
        current.skip,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        num_workers=current.workers,
        interleave=True,
        world_size=world,
    )
    return _dropped(_in_process(loader, rest), int(state.get(keys.REPLAYED, 0)))


def _in_process(loader: DataLoader, rest):
    """One epoch of `rest` (already batched) in this process."""
    whole = None
    if loader.batch_size is not None:
        whole = loader.collate_fn
    return iter(DataLoader(rest, batch_size=None, collate_fn=whole, pin_memory=loader.pin_memory))


def _fresh_workers(loader: DataLoader, rest):
    """One epoch of `rest` (a resumed copy of the dataset) on fresh workers, then the loader's own
    again."""
    kwargs = dict(
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
    )
    if loader.num_workers:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return iter(DataLoader(rest, **kwargs))


def _resumed_by_dataset(loader: DataLoader, starts: EpochStarts, states: dict, first_worker: int):
    """The rest of an epoch (or the next epoch) of a dataset that resumes itself: each dataset
    copy (this process's, or each worker's, in fresh workers) loads the state it had after its
    last batch the loop received, in torchdata's order (the dataset's, `iter`, the iterator's),
    and the round-robin resumes at the worker whose turn was next."""
    if loader.num_workers:
        return starts.loading_states(states, first_worker)
    # torchdata's order: the dataset's state, iter(dataset), the iterator's state
    main = copy.deepcopy(states.get("main") or {})  # a dataset may keep and change what it is given
    if main.get("dataset") is not None:
        loader.dataset.load_state_dict(main["dataset"])
    inner = starts.plain()
    fetcher = inner._dataset_fetcher
    if main.get("iterator") is not None:
        fetcher.dataset_iter.load_state_dict(main["iterator"])
    fetcher.ended = bool(main.get("ended"))
    return inner


_END = object()


def _dropped(iterator, count: int):
    """`iterator` after its first `count` batches (read and discarded; a worker's stream end,
    `dataset_state.Carried`, is not one)."""
    while count > 0:
        item = next(iterator, _END)
        if item is _END:
            break
        count -= not (isinstance(item, Carried) and item.ended and item.batch is None)
    return iterator
