"""Weights set by the training loop (issue 48): `MixtureSampler.set_weights` at 3 steps on 2
ranks, stopped after the second change and resumed on 3 ranks from rank 0's loader state,
receives exactly what an uninterrupted run with the same changes receives (each sample once
over both runs, the resumed ranks' padding stated); the state stays under 2 KB after 1,000
changes; bad weights are refused. Ranks that pass different weights under torch.distributed:
test_mixture_distributed.py."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import ConcatDataset, Dataset

from recipes.common import LengthBucketSampler, MixtureSampler, Schedule, make_loader

SIZES = [300, 200, 100]
BATCH = 8
CHANGES = ([0.1, 0.1, 0.8], [0.6, 0.3, 0.1], [0.2, 0.7, 0.1])


class Ids(Dataset):
    def __init__(self, first, n):
        self.first = first
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.first + int(i)


def _data():
    firsts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    return ConcatDataset([Ids(int(f), n) for f, n in zip(firsts, SIZES, strict=True)])


def _rank(world, rank, **settings):
    mix = MixtureSampler(
        SIZES, [0.5, 0.3, 0.2], seed=7, batch_size=BATCH, num_replicas=world, rank=rank, **settings
    )
    mix.set_epoch(1)
    return mix, make_loader(_data(), batch_sampler=mix, num_workers=0)


def _uninterrupted(changes_at, **settings):
    """One rank receiving every global batch, the weights changed where the run changed them
    (`changes_at`: global batch -> weights)."""
    mix, loader = _rank(1, 0, **settings)
    got = []
    iterator = iter(loader)
    while True:
        if len(got) in changes_at:
            assert mix.set_weights(changes_at[len(got)]) == len(got)
        batch = next(iterator, None)
        if batch is None:
            return got
        got.append(batch.tolist())


@pytest.mark.parametrize("stop", ["drop_exhausted", "never"])
def test_changes_on_two_ranks_resume_on_three_as_the_uninterrupted_run(stop):
    settings = {"stop": stop}
    if stop == "never":
        settings["num_samples"] = 500
    two = [_rank(2, r, **settings) for r in range(2)]
    iterators = [iter(loader) for _, loader in two]
    first_run = []
    changes_at = {}
    for step in range(9):
        if step in (3, 6):  # the loop changes the weights on both ranks at the same step
            positions = {mix.set_weights(CHANGES[len(changes_at)]) for mix, _ in two}
            assert len(positions) == 1  # the ranks agree: the next global batch not drawn
            changes_at[positions.pop()] = CHANGES[len(changes_at)]
        first_run += [next(it).tolist() for it in iterators]
    state = json.loads(json.dumps(two[0][1].state_dict()))
    done = 9 * 2

    three = [_rank(3, r, **settings) for r in range(3)]
    for _, loader in three:
        loader.load_state_dict(state)
    iterators = [iter(loader) for _, loader in three]
    resumed = [[] for _ in three]
    step = 0
    while True:
        if step == 2:
            positions = {mix.set_weights(CHANGES[2]) for mix, _ in three}
            assert positions == {done + 2 * 3}
            changes_at[done + 2 * 3] = CHANGES[2]
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            assert all(b is None for b in batches)  # equal counts on every rank
            break
        for rank, batch in enumerate(batches):
            resumed[rank].append(batch.tolist())
        step += 1

    whole = _uninterrupted(changes_at, **settings)
    assert first_run == whole[:done]  # rank 0, rank 1, rank 0, ... = the global order
    rest = whole[done:]
    padding = whole[: (-len(rest)) % 3]  # the resumed ranks' padding: the first batches again
    dealt = rest + padding
    for rank in range(3):
        assert resumed[rank] == dealt[rank::3]
    received = Counter(i for batch in first_run + sum(resumed, []) for i in batch)
    expected = Counter(i for batch in whole + padding for i in batch)
    assert received == expected
    if stop == "drop_exhausted":  # every sample of the epoch once, and the padding's
        assert +(received - Counter(i for b in padding for i in b)) == Counter(range(600))
    # the changes did change the draws: the weights after the first change favour source 2
    sources = np.searchsorted(np.cumsum(SIZES), [i for b in whole[6:12] for i in b], "right")
    assert np.mean(sources == 2) > 0.5


def test_the_state_stays_under_2kb_after_1000_changes():
    schedule = Schedule([(0.0, [0.5, 0.3, 0.2]), (0.5, [0.2, 0.3, 0.5])], total=20_000)
    mix = MixtureSampler(SIZES, schedule, stop="never", num_samples=10_000, batch_size=BATCH)
    loader = make_loader(_data(), batch_sampler=mix, num_workers=0)
    iterator = iter(loader)
    rng = np.random.default_rng(0)
    for _ in range(1000):
        next(iterator)
        mix.set_weights(rng.random(3) + 0.01)
    size = len(json.dumps(loader.state_dict()))
    assert size < 2048, size


def test_weights_carry_into_the_next_epoch():
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2], stop="never", num_samples=300)
    mix.set_weights([0.0, 0.0, 1.0])  # before the epoch: all of it
    assert (mix.source_of(list(mix)) == 2).all()
    mix.set_epoch(1)
    assert (mix.source_of(list(mix)) == 2).all()


def test_bad_weights_are_refused():
    mix = MixtureSampler({"a": 5, "b": 5}, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match="unknown source"):
        mix.set_weights({"a": 1, "c": 1})
    with pytest.raises(ValueError, match="positive sum"):
        mix.set_weights({"a": 0, "b": 0})
    with pytest.raises(ValueError, match="one value per source"):
        mix.set_weights([1, 2, 3])


SCRIPT = Path(__file__).with_name("dist_mixture_script.py")


def _torchrun(ranks, mode, folder):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            str(SCRIPT),
            mode,
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads((folder / f"{mode}-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow  # three torchrun launches (about 20 s): in the full suite (CI)
def test_under_torchrun_changes_agree_resume_on_three_ranks_and_mismatches_are_named(tmp_path):
    """Real ranks through make_loader's default path, which reads ahead: the ranks agree on
    where each change lands, a resume on 3 ranks from rank 0's state receives what an
    uninterrupted run with the same changes would, and other weights on rank 1 raise on both
    ranks, naming rank 1."""
    mismatch = _torchrun(2, "mismatch", tmp_path)
    for rank in range(2):
        assert "rank(s) [1]" in mismatch[rank]["error"]
    first = _torchrun(2, "changes", tmp_path)
    resumed = _torchrun(3, "resume", tmp_path)
    assert first[0]["changes"] == first[1]["changes"]  # agreed
    assert resumed[0]["changes"] == resumed[1]["changes"] == resumed[2]["changes"]
    changes_at = {int(k): v for part in (first[0], resumed[0]) for k, v in part["changes"].items()}
    assert len(changes_at) == 3
    whole = _uninterrupted(changes_at)
    done = 9 * 2
    in_order = [b for step in zip(*(part["batches"] for part in first), strict=True) for b in step]
    assert in_order == whole[:done]
    rest = whole[done:]
    padding = whole[: (-len(rest)) % 3]
    dealt = rest + padding
    for rank in range(3):
        assert resumed[rank]["batches"] == dealt[rank::3]
    received = Counter(
        i for part in first + resumed for batch in part["batches"] for i in batch
    ) - Counter(i for batch in padding for i in batch)
    assert received == Counter(range(600))  # every sample of the epoch once over both runs


def test_set_weights_is_refused_under_a_bucketing_sampler():
    """A bucketing sampler draws the mixture's epoch whole and saves no change: refused, not
    silently lost on resume."""
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2], num_replicas=1, rank=0)
    LengthBucketSampler(np.ones(sum(SIZES), np.int64), batch_size=4, mixture=mix)
    with pytest.raises(ValueError, match="bucketed by a LengthBucketSampler"):
        mix.set_weights([1, 1, 1])


@pytest.mark.parametrize("stop", ["drop_exhausted", "cycle_until_all_exhausted", "never"])
def test_a_change_after_the_epoch_ends_keeps_its_length_and_carries_into_the_next(stop):
    # Issue 48 break: under "cycle_until_all_exhausted" a change after the last position drew
    # a new rest past the epoch's end (96 positions became 116).
    mix = MixtureSampler(
        [50, 30], [0.5, 0.5], stop=stop, num_samples=100 if stop == "never" else None
    )
    first = list(mix)
    assert mix.set_weights([0.0, 1.0]) == len(first)
    assert len(mix) == len(first)
    assert list(mix) == first
    mix.set_epoch(1)
    assert (mix.source_of(list(mix))[:30] == 1).all()
