"""The issue #19 repros as plain regression tests, each counted against an uninterrupted run:
persistent workers in later epochs, RobustLoader restarts in later epochs and with a user
sampler's generator, checkpoints at epoch boundaries, states under other settings, several
persistent loaders alive at once, and the warnings for random state the loader cannot see.
What a later review found is in `test_resume_regressions.py`."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler

from recipes.common import LoaderWarning, RobustLoader, make_loader
from tests.common.resume.resume_checks import Ids, distributed, flat, repeated_and_lost, shuffled

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("epoch, k", [(0, 5), (1, 5), (1, 11), (2, 5)])
def test_persistent_workers_resume_in_a_later_epoch(epoch, k):
    """Repro 1: make_loader's defaults (persistent workers), resumed in epoch 1 or 2."""
    reference = shuffled()
    for _ in range(epoch):
        list(reference)
    expected = flat(reference)
    first = shuffled()
    for _ in range(epoch):
        list(first)
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    torch.manual_seed(99)  # the resumed process seeds differently: the state carries the order
    second = make_loader(Ids(), batch_size=4, shuffle=True, num_workers=2)
    second.load_state_dict(state)
    got = flat(prefix) + flat(second)
    assert repeated_and_lost(got, 48) == (0, 0)
    assert got == expected
    assert flat(second) == flat(reference)  # and the epoch after it is the uninterrupted run's too


@pytest.mark.parametrize("fault_at", [3, 29])
def test_robust_loader_survives_a_kill_in_a_later_epoch(fault_at, tmp_path):
    """Repro 2: RobustLoader with persistent workers, a worker SIGKILLed in epoch 1."""
    marker = tmp_path / "fired"
    torch.manual_seed(0)
    reference = make_loader(Ids(), batch_size=4, shuffle=True, num_workers=2)
    list(reference)
    expected = flat(reference)
    marker.touch()  # epoch 0 runs without the fault
    torch.manual_seed(0)
    loader = RobustLoader(
        Ids(marker=marker, fault_at=fault_at), batch_size=4, shuffle=True, num_workers=2, timeout=30
    )
    list(loader)
    marker.unlink()
    with pytest.warns(LoaderWarning, match="worker died"):
        got = flat(loader)
    assert marker.exists() and [c for c, _ in loader.restarts] == ["death"]
    assert repeated_and_lost(got, 48) == (0, 0)
    assert got == expected


def test_robust_loader_restores_a_user_samplers_generator(tmp_path):
    """Repro 2: a RandomSampler with its own seeded generator, a worker SIGKILLed at index 77."""
    ds = Ids(200, tmp_path / "fired", fault_at=77)
    expected = flat(
        make_loader(
            Ids(200),
            batch_size=4,
            num_workers=0,
            sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(5)),
        )
    )
    loader = RobustLoader(
        ds,
        batch_size=4,
        num_workers=2,
        timeout=30,
        sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(5)),
    )
    with pytest.warns(LoaderWarning, match="worker died"):
        got = flat(loader)
    assert repeated_and_lost(got, 200) == (0, 0)
    assert got == expected


def test_a_checkpoint_after_an_epoch_resumes_the_next_epoch_whole():
    """Repro 3: finish epoch 0, save, resume, set_epoch(1): all 12 batches of epoch 1."""
    reference = distributed()
    reference.sampler.set_epoch(1)
    expected = flat(reference)
    first = distributed()
    list(first)
    resumed = distributed()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed.sampler.set_epoch(1)
    assert flat(resumed) == expected and len(expected) == 24
    # saved after set_epoch(1), before its first batch: epoch 1 whole, with or without set_epoch
    # again
    first.sampler.set_epoch(1)
    state = first.state_dict()
    for call_set_epoch in (False, True):
        resumed = distributed()
        resumed.load_state_dict(state)
        if call_set_epoch:
            resumed.sampler.set_epoch(1)
        assert flat(resumed) == expected


def test_end_of_epoch_before_and_after_the_loop_ended():
    """Saved after the last batch but inside the loop: the rest is empty, then the next epoch.
    Saved after the loop ended: the next epoch (a loader that counts its own epochs)."""
    reference = shuffled()
    epochs = [flat(reference) for _ in range(3)]
    first = shuffled()
    iterator = iter(first)
    for _ in range(len(first)):
        next(iterator)
    inside = first.state_dict()
    assert next(iterator, None) is None
    after = first.state_dict()
    resumed = shuffled()
    resumed.load_state_dict(inside)
    assert flat(resumed) == [] and flat(resumed) == epochs[1]
    resumed = shuffled()
    resumed.load_state_dict(after)
    assert flat(resumed) == epochs[1] and flat(resumed) == epochs[2]


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    from recipes.nlp import build_token_cache
    from recipes.testing import make_text_corpus, train_tokenizer

    texts = make_text_corpus(300, seed=1)
    return build_token_cache(
        texts,
        train_tokenizer(texts, vocab_size=300),
        tmp_path_factory.mktemp("tok"),
        progress=False,
    )


def test_packed_loader_resumes_the_epoch_set_after_the_last_one(token_cache):
    """Repro 3, packed: after set_epoch(1) the state is epoch 1 at its start."""
    from recipes.nlp import packed_loader

    def build():
        return packed_loader(token_cache, seq_len=64, batch_size=2, num_workers=2)

    reference = build()
    reference.batch_sampler.set_epoch(1)
    expected = [b["input_ids"] for b in reference]
    first = build()
    list(first)
    first.batch_sampler.set_epoch(1)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batches_yielded"] == 0
    resumed = build()
    resumed.load_state_dict(state)
    got = [b["input_ids"] for b in resumed]
    assert len(got) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(got, expected, strict=True)
    )


@pytest.mark.parametrize(
    "change",
    [
        {"max_docs_per_row": 3},
        {"shuffle": False},
        {"window": 8},
        {"split_long": False, "seq_len": 4096},
        {"seed": 1},
    ],
)
def test_a_packed_state_under_other_settings_is_refused(change, token_cache):
    """Repro 4: every setting that shapes the plan is carried and checked."""
    from recipes.nlp import packed_loader

    settings = {"seq_len": 64, "batch_size": 2, "num_workers": 0, "max_docs_per_row": 4}
    loader = packed_loader(token_cache, **settings)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    other = packed_loader(token_cache, **{**settings, **change})
    with pytest.raises(ValueError, match=next(iter(change))):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=next(iter(change))):
        other.batch_sampler.load_state_dict(state["sampler"])


@pytest.mark.parametrize("change", [{"batch_size": 8}, {"drop_last": True}, {"n": 40}])
def test_a_loader_state_under_other_settings_is_refused(change):
    settings = {"batch_size": 4, "drop_last": False, "n": 48}
    first = make_loader(Ids(settings["n"]), batch_size=4, shuffle=True, num_workers=0)
    other = {**settings, **change}
    second = make_loader(
        Ids(other["n"]),
        batch_size=other["batch_size"],
        shuffle=True,
        num_workers=0,
        drop_last=other["drop_last"],
    )
    with pytest.raises(ValueError, match="saved under other settings"):
        second.load_state_dict(first.state_dict())


def test_a_distributed_sampler_on_another_number_of_ranks_is_refused():
    first = distributed()
    sampler = DistributedSampler(Ids(), num_replicas=4, rank=0, shuffle=True, seed=0)
    second = make_loader(Ids(), batch_size=2, sampler=sampler, num_workers=0)
    with pytest.raises(ValueError, match="num_replicas: 2 .saved. vs 4"):
        second.load_state_dict(first.state_dict())


def test_the_state_is_small_and_does_not_grow():
    loader = shuffled()
    sizes = []
    for _ in range(3):
        iterator = iter(loader)
        next(iterator)
        sizes.append(len(json.dumps(loader.state_dict())))
        del iterator
    assert len(set(sizes)) == 1 and sizes[0] < 16_000


def test_a_state_loads_in_a_fresh_process(zygote, tmp_path):
    """Saved here in epoch 1, resumed in another process that never saw the loader (forked from
    a fresh interpreter): prefix + rest is the uninterrupted epoch."""
    reference = shuffled()
    list(reference)
    expected = flat(reference)
    first = shuffled()
    list(first)
    iterator = iter(first)
    prefix = flat([next(iterator) for _ in range(5)])
    script = textwrap.dedent("""
        import json, sys, torch
        from torch.utils.data import Dataset
        from recipes.common import make_loader

        class Ids(Dataset):
            def __len__(self): return 48
            def __getitem__(self, i): return i

        torch.manual_seed(5)
        loader = make_loader(Ids(), batch_size=4, shuffle=True, num_workers=2)
        loader.load_state_dict(json.loads(open(sys.argv[1]).read()))
        print(json.dumps([i for b in loader for i in b.tolist()]))
    """)
    (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
    done = zygote.python(script, tmp_path / "state.json", cwd=ROOT)
    assert done.wait(timeout=120) == 0, done.stderr[-3000:]
    assert prefix + json.loads(done.stdout) == expected


SEVERAL_LOADERS = textwrap.dedent("""
    import gc, sys, torch
    from torch.utils.data import Dataset
    from recipes.common import make_loader

    class Ids(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i): return i

    def collect_in_worker(worker_id):
        gc.collect()  # what a busy worker's garbage collector does at any moment

    train = make_loader(Ids(), batch_size=4, shuffle=True, num_workers=2)
    for epoch in range(2):
        val = make_loader(Ids(), batch_size=8, num_workers=2, worker_init_fn=collect_in_worker)
        val.cycle = val  # a cycle of the user's: the loader is garbage only for the collector
        for batch in train:
            pass
        assert sum(len(b) for b in val) == 64
        del val
        torch.utils.data.get_worker_info()
    print("ok", flush=True)
""")


@pytest.mark.slow  # 3-6 s
def test_several_persistent_loaders_alive_at_once():
    """Repro 5: train and validation loaders with persistent workers; the validation loaders
    become cyclic garbage, inherited by the next loaders' forked workers, which collect it."""
    done = subprocess.run(
        [sys.executable, "-c", SEVERAL_LOADERS],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    assert "can only test a child process" not in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_dropped_loader_shuts_its_persistent_workers_down_without_a_collection():
    """No loader -> iterator -> loader cycle: the workers go with the last reference."""
    import gc

    loader = make_loader(Ids(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    workers = list(loader._iterator._workers)
    gc.disable()
    try:
        del loader
        for w in workers:
            w.join(timeout=10)
        assert all(w.exitcode is not None for w in workers)
    finally:
        gc.enable()


class GlobalRandom(Sampler):
    """Draws its order from torch's global generator: nothing a state can restore."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_a_sampler_drawing_from_the_global_generator_is_named():
    loader = make_loader(Ids(), batch_size=4, sampler=GlobalRandom(48), num_workers=0)
    with pytest.warns(
        LoaderWarning, match="GlobalRandom drew its order from torch's global random generator"
    ):
        next(iter(loader))


class Hidden(Sampler):
    """Keeps its generator in a closure: invisible to the loader."""

    def __init__(self, n):
        self.n = n
        g = np.random.default_rng(0)
        self.draw = lambda: g.permutation(n).tolist()

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.draw())


class HalfEpoch(Hidden):
    def set_epoch(self, epoch):
        self.seed = epoch


@pytest.mark.parametrize(
    "sampler, match",
    [
        (Hidden(48), "cannot see the random state of the sampler Hidden"),
        (HalfEpoch(48), "set_epoch.. but no `epoch` attribute"),
    ],
)
def test_a_sampler_with_state_the_loader_cannot_see_is_named_at_state_dict(sampler, match):
    loader = make_loader(Ids(), batch_size=4, sampler=sampler, num_workers=0)
    next(iter(loader))
    with pytest.warns(LoaderWarning, match=match):
        loader.state_dict()


class Private(Sampler):
    """Keeps its generator under a private attribute: reached by the attribute walk."""

    def __init__(self, n, seed):
        self.n, self._rng = n, np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self._rng.permutation(self.n).tolist())


def test_a_private_generator_attribute_is_captured_and_restored():
    def build(seed):
        return make_loader(Ids(), batch_size=4, sampler=Private(48, seed), num_workers=2)

    reference = build(3)
    list(reference)
    expected = flat(reference)
    first = build(3)
    list(first)
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator
    second = build(8)
    second.load_state_dict(state)
    assert flat(prefix) + flat(second) == expected
