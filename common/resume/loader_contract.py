"""The loader's state contract: what a sampler or dataset implements to be resumed exactly,
and what `StatefulLoader` (`make_loader`'s loader) guarantees in return.

Use when: you write a sampler, batch sampler or dataset of your own and want
`loader.state_dict()` / `RobustLoader` to resume it without losing or repeating a sample; or
you want to know what the loader does with yours. Every hook is structural (`typing.Protocol`):
implement the methods, import nothing.
Cost: none at run time; `isinstance` checks against these protocols happen once per loader.
Adapt here: nothing; this file is the contract the loader is tested against
(`tests/common/resume/test_exactly_once.py`).
Trade-off: the loader resumes what it can see. A sampler that draws its order from a random
generator it hides (in a closure, a module global, the global RNGs) cannot be resumed by
anyone; the loader detects the global RNGs being drawn from and says so (`LoaderWarning`).

What the loader guarantees (the state is plain JSON, constant size, loaded in a fresh process):
- It counts the batches the training loop *received*, never what workers fetched.
- It records the epoch and the random state the epoch's order is drawn from, captured at the
  moment the order is drawn (the first index of the epoch), whatever the worker count,
  persistence or prefetch. How it captures that state, by what the sampler offers:
  1. `EpochSeeded` (`set_epoch` + `epoch`: `DistributedSampler`, `LengthBucketSampler`,
     `ShardedIterableDataset`): the epoch; the order is a function of (seed, epoch).
  2. Random generators it holds as attributes (`torch.Generator`, `numpy.random.Generator`,
     `numpy.random.RandomState`, `random.Random`, found up to three attributes deep, as
     `RandomSampler(generator=g)` holds one): their states at the draw. A generator also
     passed to the loader as `generator=` is replaced there (for the workers' base seed) by
     one seeded from it, so that the order never depends on the workers.
  3. `StatefulSampler` (`state_dict()` / `load_state_dict()`) when neither of the above applies:
     its state at the draw, restored at the resumed draw. (torchdata's samplers keep their
     position in the pass in that state; they are epoch-seeded or hold a generator, which the
     loader uses instead, counting the loop's batches itself.)
  4. Nothing random (`SequentialSampler`, a list of indices): nothing to capture.
  An iterable dataset is resumed by its `resume_after` (`ResumableIterable`), else by its own
  `state_dict()` or its iterator's (`StatefulDataset`, per worker), else by replaying the
  epoch's first batches.
  Every epoch's first draw is also watched: a sampler that draws from torch's, NumPy's or
  Python's global random generator gets a `LoaderWarning` (no state can restore those).
- A pass ends when its iterator is exhausted (`StopIteration`); a loop left early (`break`,
  an error) only pauses it. A state saved mid-pass (or paused) resumes at the first batch the
  loop did not receive; one saved after a pass ended resumes at the start of the next epoch
  (the next `set_epoch`, or the next iteration for a loader that counts its epochs) and names
  the epoch that ended (`finished_epoch`); one saved after `set_epoch(e)` and before the
  epoch's first batch resumes at the start of e.
- A map-style dataset's own random draws (`torch.rand`, `np.random`, `random` in
  `__getitem__`) are seeded per batch from `(seed, epoch, position)` (`batch_seeds.py`): a
  resumed run draws what the uninterrupted one drew, with any number of workers.
- `load_state_dict` refuses a state saved under other settings that shape the plan
  (batch size, `drop_last`, dataset size, the sampler's own settings via `plan_settings()`).
- `PositionedBatchSampler`, `PositionedSampler` and `ResumableIterable` resume on another
  number of ranks (elastic): every new rank loads rank 0's state (or its own) and the rest of
  the epoch is dealt over the new ranks, every sample once (padding to equal steps counted).
- An `EpochAdvancing` sampler moves to the next epoch when the loop iterates again without
  `set_epoch`.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol, runtime_checkable

JSON = Any  # a value `json.dumps` accepts


@runtime_checkable
class EpochSeeded(Protocol):
    """The order of an epoch is a function of `(seed, epoch)`: `set_epoch(epoch)` before each
    epoch, and `epoch` reads it back (the loader compares it with a loaded state's epoch to
    tell a resumed epoch from a new one)."""

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class EpochAdvancing(Protocol):
    """An `EpochSeeded` sampler whose epoch the loader moves on when the loop does not
    (`advance_epochs` true: `ElasticDistributedSampler`): iterated again while still at the epoch
    of its last whole pass (no `set_epoch` since, or `set_epoch` to that same epoch), it gets
    `set_epoch(epoch + 1)` first, so a loop that never calls `set_epoch` gets a new order each
    epoch. A loop that does call it each epoch sees no difference."""

    advance_epochs: bool


@runtime_checkable
class StatefulSampler(Protocol):
    """A sampler whose order follows from its state when `iter` is called (torchdata's
    `Stateful`): the loader saves `state_dict()` at the draw and restores it at the resumed draw,
    then skips the batches the loop had received."""

    def state_dict(self) -> dict[str, JSON]: ...

    def load_state_dict(self, state: dict[str, JSON]) -> None: ...


@runtime_checkable
class StatefulDataset(Protocol):
    """An iterable dataset, or the iterator its `__iter__` returns, that keeps its own position
    (torchdata's protocol; Hugging Face `datasets.IterableDataset`): the loader saves, per
    worker, the state of the dataset copy that made the last batch the loop received (and of
    its iterator), and loads it into that worker's copy on resume: the dataset's before
    `iter(dataset)`, the iterator's after (`dataset_state.py`). `resume_after` takes precedence."""

    def state_dict(self) -> dict[str, JSON]: ...

    def load_state_dict(self, state: dict[str, JSON]) -> None: ...


@runtime_checkable
class PositionedBatchSampler(Protocol):
    """A batch sampler that keeps its own global position over all ranks (`LengthBucketSampler`,
    `PackedBatchSampler`), so a resume may change the number of ranks.

    `state_dict(batches_done=k)`: the position after this rank's loop received `k` batches of
    the current pass (the loader passes its count; the sampler's own count runs ahead by the
    workers' prefetch). `load_state_dict(state)`: the next pass continues from it, on this
    sampler's number of ranks. It is also `EpochSeeded`.
    """

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self, *, batches_done: int | None = None) -> dict[str, JSON]: ...

    def load_state_dict(self, state: dict[str, JSON]) -> None: ...


@runtime_checkable
class PositionedSampler(Protocol):
    """A sampler that keeps its own global position over all ranks (`ElasticDistributedSampler`,
    `MixtureSampler` in index mode), batched by torch's `BatchSampler`: `state_dict(samples_done=k)`
    is the position after this rank's loop received `k` samples of the current pass (the loader
    passes batches x batch size); `load_state_dict(state)` continues from it on this sampler's
    number of ranks. It is also `EpochSeeded`."""

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self, *, samples_done: int | None = None) -> dict[str, JSON]: ...

    def load_state_dict(self, state: dict[str, JSON]) -> None: ...


@runtime_checkable
class ResumableIterable(Protocol):
    """An iterable dataset that resumes without reading what it skips (`ShardedIterableDataset`).

    `resume_after(batches_done, batch_size=, drop_last=, num_workers=, interleave=, world_size=)`
    returns a copy whose next epoch starts after the first `batches_done` batches that a
    DataLoader with those settings yielded; `interleave=True` asks for the rest of the epoch as
    whole batches in the old order, in one process (another worker count than the interrupted
    epoch), and `world_size` names the old number of ranks when it differs (elastic).
    """

    world_size: int

    def resume_after(
        self,
        batches_done: int,
        *,
        batch_size: int | None,
        drop_last: bool = False,
        num_workers: int = 0,
        interleave: bool = False,
        world_size: int | None = None,
    ): ...


@runtime_checkable
class PlanShaped(Protocol):
    """`plan_settings()`: every setting that shapes the plan (which samples, in which batches,
    in which order), as plain JSON; a loader state carries it, and `load_state_dict` refuses a
    state whose settings differ."""

    def plan_settings(self) -> dict[str, JSON]: ...


@runtime_checkable
class ReadAheadAware(Protocol):
    """`note_read_ahead(batches)`: the loader tells a sampler how many batches its workers may
    hold beyond what the loop received, so that the sampler's own `state_dict()` can warn."""

    def note_read_ahead(self, batches: int) -> None: ...


@runtime_checkable
class Prefetching(Protocol):
    """`start_downloads(num_workers)`: called by the loader in the main process when a fresh
    epoch starts, before its workers fork, to start the epoch's first downloads."""

    def start_downloads(self, num_workers: int | None = None) -> list: ...


@runtime_checkable
class ThreadBatched(Protocol):
    """A map-style dataset whose batches threads can read (`ThreadLoader`, chosen by
    `make_loader` when `thread_batches()` is true): its items are made by work that releases the
    GIL (memory-speed reads from a cache, or native decoding such as OpenCV's). A pool thread makes
    each batch: with a `collate_fn`, `collate_fn(dataset.__getitems__(indices))` (or the items one
    by one); without one, the dataset's optional `read_batch(indices, rng)` (the collated batch,
    every random draw from `rng`, seeded by the loader per batch; `read_batch_collate` names the
    collate function whose output it equals), else `default_collate`. Both must be safe in several
    threads at once."""

    def thread_batches(self) -> bool: ...


@runtime_checkable
class ReadAheadKeyed(Protocol):
    """`read_ahead_key()`: every setting `read_batch` depends on besides its indices and its
    generator, as a value that compares equal while the batches would be the same (a
    resolution, the crops' settings, the cache attached). A `ThreadBatched` dataset that has it
    lets the thread paths make the next epoch's first batches at this epoch's end
    (`epoch_read_ahead.py`), served only while the key is unchanged; without it each batch is
    made in its own epoch, and any change between epochs, in place or not, is seen. Values only
    (numbers, strings, enums, paths, types, tuples, frozensets, dataclasses by their fields), and
    an object named by identity wrapped in `epoch_read_ahead.ByIdentity` (a cache attached): a
    key holding anything else (a list, a dict, an array, a tensor, another object), or one that
    raises, means no read-ahead. Called from the pool's threads too: cheap, no side effects."""

    def read_ahead_key(self) -> Hashable: ...


@runtime_checkable
class TuneKeyed(Protocol):
    """`tune_key()`: what identifies the dataset for `autotune`'s stored results."""

    def tune_key(self) -> str: ...


# Plain attributes `make_loader` reads from a dataset, when present:
# - `recommended_profile: str`: the loader profile `profile="auto"` picks (`TokenCache`: "text");
# - `uses_cuda_in_workers: bool`: workers start by `forkserver` instead of `fork`.
