"""A forked worker that never starts (CPython gh-112275) is replaced, and the epoch is the
uninterrupted one: every batch once, in order, with the same random draws."""

import json

import pytest

# Each launch registers an at-fork hook in a child of the zygote (hooks cannot be removed): from
# the fork numbered `first` on, the next `count` forked children wait forever before any Python
# of theirs runs, as a child that copied a held interpreter lock does.
SCRIPT = r"""
import json, mmap, os, sys, time, warnings
import torch
from torch.utils.data import Dataset
from recipes.common import RobustLoader, make_loader
from recipes.common.workers import start_watch

start_watch.START_SECONDS = 0.5
kind, count, persistent = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "persistent"
forks = mmap.mmap(-1, 8)  # [armed, forks since armed]

def stick():
    if forks[0]:
        forks[1] += 1
        if forks[1] <= count:
            while True:
                time.sleep(1)

os.register_at_fork(after_in_child=stick)

class Draws(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        return torch.tensor([i, int(torch.randint(1 << 30, ()))])

    def thread_batches(self):  # may take the isolated path
        return True

def build():
    kw = dict(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7), num_workers=2,
              path="workers", persistent_workers=persistent)
    if kind == "build":  # a cache build's DataLoader, in index order
        from recipes.common.loading.build_loader import build_loader
        return build_loader(Draws(), num_workers=2, batch_size=4, collate_fn=None)
    if kind == "isolated":  # the child process of the thread path (one, kept for both epochs)
        generator = torch.Generator().manual_seed(7)
        return make_loader(
            Draws(), batch_size=4, shuffle=True, generator=generator, path="isolated"
        )
    if kind == "robust":
        return RobustLoader(Draws(), timeout=600, **kw)
    return make_loader(Draws(), **kw)

def epochs(loader, n=2):
    return [[b.tolist() for b in loader] for _ in range(n)]

want = epochs(build())
loader = build()
forks[0] = 1
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = epochs(loader)
warned = [str(w.message) for w in caught if "had not started" in str(w.message)]
print(json.dumps({"want": want, "got": got, "forks": forks[1], "warnings": warned}))
"""


@pytest.mark.parametrize(
    "kind, count, persistent, started",
    [
        ("make_loader", 1, "fresh", 4),
        ("make_loader", 2, "persistent", 2),
        ("robust", 1, "fresh", 4),
        ("isolated", 1, "fresh", 1),
        ("build", 1, "fresh", 4),
    ],
)  # started: the processes the two epochs fork, without the replacements
def test_a_worker_stuck_in_its_fork_is_replaced_and_the_epochs_are_the_uninterrupted_ones(
    zygote, kind, count, persistent, started
):
    child = zygote.python(SCRIPT, kind, str(count), persistent)
    child.wait(timeout=120)  # without the watch: waits forever on the stuck worker's batches
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.splitlines()[-1])
    want, got = report["want"], report["got"]
    for epoch in range(2):
        samples = [row[0] for batch in got[epoch] for row in batch]
        assert sorted(samples) == list(range(48)) and len(samples) == 48  # each sample exactly once
        if kind in (
            "isolated",
            "build",
        ):  # draws from a generator shared by threads, or seeded per iterator
            assert samples == [row[0] for batch in want[epoch] for row in batch]  # same order
        else:
            assert (
                got[epoch] == want[epoch]
            )  # same order, same random draws (the same seed per worker)
    assert len(report["warnings"]) == count
    assert "gh-112275" in report["warnings"][0]
    assert report["forks"] == started + count
