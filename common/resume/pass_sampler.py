"""`PassSampler`: the loader's index sampler, where each pass's order is drawn and its state
captured.

Use when: you read how `StatefulLoader` hooks DataLoader (its `_index_sampler` property wraps
DataLoader's own in this): at a pass's first index the loaded random state is restored and the
one the order is drawn from captured (`Passes.draw`), global random draws are watched, a
resume's first batches are skipped (indices only), and each index carries its batch's seed.
Cost: per batch, one seed mixed (`batch_seeds.py`); per pass, one capture.
Adapt here: nothing.
Trade-off: DataLoader reads `_index_sampler` once per iterator and iterates it once per epoch;
`tests/common/resume/test_exactly_once.py` fails if a torch release moves that.
Copy with: common/loader_warning.py, common/resume/batch_seeds.py, common/resume/loader_state.py,
  common/resume/state_keys.py, common/resume/state_records.py.
"""

from __future__ import annotations

import itertools
import warnings

import recipes.common.resume.state_keys as keys
from recipes.common.loader_warning import LoaderWarning
from recipes.common.resume.batch_seeds import batch_seed, seeded
from recipes.common.resume.loader_state import GlobalDraws

_END = object()


class PassSampler:
    """The loader's index sampler: at a pass's first index, the random state is restored and
    captured (`Passes.draw`), global random draws are watched, and a resume's first batches are
    skipped (indices only)."""

    def __init__(self, inner, passes):  # `loader_passes.Passes`
        self.inner = inner
        self.passes = passes
        self.created_for = passes.current  # the pass whose iterator reads this sampler first

    def __iter__(self):  # a generator: nothing runs until DataLoader asks for the first index
        passes = self.passes
        current = self.created_for
        if passes.iterable:
            yield from self._iterable_indices()
            return
        if current is None or current.drawn:  # a persistent iterator's later pass
            current = passes.current
        if current is None or current.drawn:  # iterated outside a pass of the loader
            yield from self.inner
            return
        passes.draw(current)
        watch = GlobalDraws()
        watch.before()
        iterator = iter(self.inner)
        first = next(iterator, _END)
        drawn = watch.after()
        if drawn:
            passes.sources.warn_global(self.inner, drawn)
        skip = current.skip
        while skip and first is not _END:
            first = next(iterator, _END)
            skip = skip - 1
        if first is _END:
            return
        if passes.seed is None or passes.iterable:
            yield first
            yield from iterator
            return
        # each batch's draws follow its position (batch_seeds.py)
        seed = passes.seed
        epoch = current.epoch
        for position, item in enumerate(
            itertools.chain((first,), iterator), start=current.position
        ):
            carried = seeded(item, batch_seed(seed, epoch, position))
            if carried is item and "unseeded" not in passes.warned:
                passes.warned.add("unseeded")
                warnings.warn(
                    f"{type(self.inner).__name__} yields {type(item).__name__} batches, which "
                    "cannot carry their batch's seed: the dataset's own random draws will not be "
                    "reproduced after a resume. Yield lists of indices to have them reproduced.",
                    LoaderWarning,
                    stacklevel=2,
                )
            yield carried

    def _iterable_indices(self):
        """An iterable dataset that may resume itself: every index carries the pass's seed, from
        which each worker seeds its generators before `iter(dataset)` (`dataset_state.py`)."""
        passes = self.passes
        current = self.passes.current
        if passes.seed is None or current is None or not passes.self_resuming:
            yield from self.inner
            return
        seed = batch_seed(passes.seed, current.epoch, 0)
        for item in self.inner:
            yield seeded(item, seed)

    def __len__(self) -> int:
        """The epoch's batches, those received before a resume included (`Pass.length`), also while
        a loaded state of a positioned sampler waits for its pass (Lightning reads it then):
        `Passes.resumed_length`."""
        waiting = self._waiting_length()
        if waiting is not None:
            return waiting
        current = self.passes.current
        if current is not None and current.length is not None and not current.done:
            return current.length
        return len(self.inner)

    def _waiting_length(self) -> int | None:
        passes = self.passes
        pending = passes.pending
        positioned = passes.positioned
        if pending is None or positioned is None or pending.get(keys.SAMPLER) is None:
            return None
        if passes.holder is not None and int(passes.holder.epoch) != pending[keys.EPOCH]:
            return None
        return passes.resumed_length(pending)
