import multiprocessing
import subprocess
import sys

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from recipes.common import PROFILES, Resources, make_loader
from recipes.common.sizing.resources import GiB


class Squares(Dataset):
    def __init__(self, n=10):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i * i], dtype=torch.int64)


class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        yield from (torch.tensor([i]) for i in range(start, 10, step))


def _res(nofile=65536, cpus=2):
    return Resources(
        cpus=cpus,
        cpus_logical=cpus,
        memory_available=16 * GiB,
        memory_limit=None,
        shm_bytes=8 * GiB,
        shm_free=8 * GiB,
        gpus=0,
        nofile_limit=nofile,
    )


@pytest.fixture
def restore_sharing_strategy():
    before = torch.multiprocessing.get_sharing_strategy()
    yield
    torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_with_zero_workers_constructs_and_iterates(profile):
    loader = make_loader(Squares(10), profile=profile, batch_size=4, num_workers=0)
    assert torch.cat(list(loader)).flatten().tolist() == [i * i for i in range(10)]
    assert loader.num_workers == 0
    assert "prefetch_factor" not in loader.recipe.settings
    assert "persistent_workers" not in loader.recipe.settings


@pytest.mark.parametrize("profile", ["production", "memory", "throughput", "text"])
def test_profiles_with_workers_iterate_in_order(profile):
    loader = make_loader(
        Squares(10), profile=profile, batch_size=3, num_workers=2, resources=_res(cpus=8)
    )
    assert loader.num_workers == 2
    for _ in range(2):  # two epochs, persistent or not
        assert torch.cat(list(loader)).flatten().tolist() == [i * i for i in range(10)]


def test_user_prefetch_with_zero_workers_is_dropped_not_raised():
    loader = make_loader(
        Squares(4), profile="production", num_workers=0, prefetch_factor=4, persistent_workers=True
    )
    assert len(list(loader)) == 1
    assert "DataLoader rejects it" in loader.recipe.reasons["prefetch_factor"]


def test_overrides_win_and_the_recipe_says_why():
    loader = make_loader(
        Squares(8),
        profile="production",
        batch_size=5,
        num_workers=1,
        drop_last=True,
        resources=_res(),
    )
    assert loader.batch_size == 5 and loader.drop_last
    assert loader.recipe.settings["num_workers"] == 1
    assert loader.recipe.reasons["num_workers"] == "override"
    assert loader.recipe.reasons["batch_size"] == "given"
    assert "between epochs" in loader.recipe.reasons["persistent_workers"]
    assert "profile: production" in str(loader.recipe)


def test_production_defaults_on_this_machine():
    loader = make_loader(Squares(8), profile="production", resources=_res(cpus=8))
    assert loader.num_workers == 6  # 8 CPUs - 2 reserved
    assert loader.prefetch_factor == 2 and loader.persistent_workers
    assert loader.pin_memory == torch.cuda.is_available()
    assert loader.batch_size == 32


def test_pins_only_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make_loader(Squares(), profile="production").pin_memory is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_loader(Squares(), profile="production", resources=_res()).pin_memory is True
    assert make_loader(Squares(), profile="text", resources=_res()).pin_memory is False


class CudaInWorkers(Squares):
    uses_cuda_in_workers = True


def test_fork_stays_when_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    loader = make_loader(Squares(), profile="production", num_workers=1, resources=_res())
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert "CUDA is initialised" in loader.recipe.reasons["multiprocessing_context"]
    assert torch.cat(list(loader)).flatten().tolist() == [i * i for i in range(10)]


def test_forkserver_only_when_the_dataset_uses_cuda_in_workers(monkeypatch):
    preloaded = []
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preloaded.extend)
    loader = make_loader(CudaInWorkers(), profile="production", num_workers=1, resources=_res())
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    assert "uses_cuda_in_workers" in loader.recipe.reasons["multiprocessing_context"]
    assert "torch" in preloaded and CudaInWorkers.__module__ in preloaded


def test_user_context_wins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    loader = make_loader(
        Squares(),
        profile="production",
        num_workers=1,
        resources=_res(),
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.recipe.reasons["multiprocessing_context"] == "override"


UNGUARDED_SCRIPT = """
import torch
from torch.utils.data import Dataset
from recipes.common import make_loader
torch.cuda.is_initialized = lambda: True  # as in a training script with the model on the GPU

class Squares(Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return torch.tensor([i * i])

loader = make_loader(Squares(), profile="production", batch_size=4, num_workers=2)
print(sorted(torch.cat(list(loader)).flatten().tolist()))
"""


def test_a_script_without_a_main_guard_runs(tmp_path):
    script = tmp_path / "train.py"  # no `if __name__ == "__main__":`, as users write them
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([i * i for i in range(10)])


def test_low_ulimit_switches_to_file_system_sharing(restore_sharing_strategy):
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    loader = make_loader(Squares(), profile="production", num_workers=1, resources=_res(nofile=256))
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    assert "ulimit -n is 256" in loader.recipe.reasons["sharing_strategy"]


def test_high_ulimit_keeps_the_default_sharing(restore_sharing_strategy):
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    make_loader(Squares(), profile="production", num_workers=1, resources=_res(nofile=65536))
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"


def _mark_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.marked = worker_id + 100


class Marked(Dataset):
    marked = None

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([self.marked, torch.get_num_threads()])


def test_user_worker_init_runs_after_worker_init():
    loader = make_loader(
        Marked(),
        profile="production",
        batch_size=1,
        num_workers=2,
        worker_init_fn=_mark_worker,
        resources=_res(),
    )
    rows = torch.cat(list(loader)).tolist()
    assert sorted({r[0] for r in rows}) == [100, 101]  # the user's init ran in each worker
    assert {r[1] for r in rows} == {1}  # and worker_init set one torch thread first
    assert loader.recipe.settings["worker_init_fn"] == "worker_init + _mark_worker"


def test_batch_sampler_override_drops_batch_size():
    loader = make_loader(
        Squares(6), profile="production", num_workers=0, batch_sampler=[[0, 1], [2, 3, 4], [5]]
    )
    assert [len(b) for b in loader] == [2, 3, 1]


def test_iterable_dataset_with_auto():
    loader = make_loader(Stream(), batch_size=5, num_workers=2, resources=_res())
    assert sorted(torch.cat(list(loader)).flatten().tolist()) == list(range(10))
    assert "sample size unknown" in loader.recipe.reasons["profile"]


def test_auto_probes_a_sample_and_picks_memory_for_huge_samples():
    class Huge(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(1)

    res = Resources(
        cpus=32,
        cpus_logical=32,
        memory_available=2 * GiB,
        memory_limit=None,
        shm_bytes=8 * GiB,
        shm_free=8 * GiB,
        gpus=8,
        nofile_limit=65536,
    )
    small = make_loader(Huge(), resources=res)
    assert small.recipe.profile == "production"

    class Big(Huge):
        def __getitem__(self, i):
            return torch.zeros(16 * 2**20, dtype=torch.uint8)

    assert make_loader(Big(), resources=res).recipe.profile == "memory"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "`batch_size` must be positive, but is 0 instead."),
        ({"num_workers": -1}, "`num_workers` must be non-negative, but is -1 instead."),
        ({"num_workers": 1.5}, "`num_workers` must be an integer, but is 1.5 instead."),
        ({"prefetch_factor": 0}, "`prefetch_factor` must be a positive integer, but is 0 instead."),
        ({"profile": "fastest"}, "`profile` must be one of"),
    ],
)
def test_invalid_values_get_the_style_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        make_loader(Squares(), **kwargs)


EARLY_EXIT = """
import torch
from recipes.common import make_loader

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        return torch.tensor([i * i])

loader = make_loader(Squares(), profile="production", num_workers=2, batch_size=4, pin_memory=False)
assert loader.persistent_workers
for epoch in range(2):
    for batch in loader:
        break  # the pytorch#1551 / #72269 pattern: leave mid-epoch with persistent workers
print("left")
"""


def test_breaking_out_with_persistent_workers_exits_promptly():
    import subprocess
    import sys
    import time

    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", EARLY_EXIT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "left" in out.stdout and time.monotonic() - start < 20
    assert "Traceback" not in out.stderr and "leaked semaphore" not in out.stderr


class Indexed(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return len(self.paths[i])


def test_large_python_lists_on_a_dataset_warn_with_workers():
    from recipes.common import LoaderWarning, PackedStrings

    paths = [f"train/{i:07d}.jpg" for i in range(150_000)]
    with pytest.warns(
        LoaderWarning, match=r"Indexed\.paths is a Python list of 150,000 items.*PackedStrings"
    ):
        make_loader(Indexed(paths), num_workers=1, resources=_res())
    subset = torch.utils.data.Subset(Indexed(paths), range(10))
    with pytest.warns(LoaderWarning, match=r"Subset\.dataset\.paths"):
        make_loader(subset, num_workers=1, resources=_res())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", LoaderWarning)
        make_loader(Indexed(paths), num_workers=0, resources=_res())  # no workers, no copies
        make_loader(Indexed(PackedStrings(paths)), num_workers=1, resources=_res())
        make_loader(Indexed(paths[:1000]), num_workers=1, resources=_res())
