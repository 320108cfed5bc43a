"""The index dataset, loaders and counts the resume tests share (`test_resume_repros.py`,
`test_resume_regressions.py`): every sample is its index, so a resumed run is checked by
comparing index lists with the uninterrupted run's."""

import os
import signal
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from recipes.common import make_loader


class Ids(Dataset):
    """Sample i is i. With `fault_at`, the first worker to load that index while `marker` does
    not exist creates it and SIGKILLs itself (one death per marker)."""

    def __init__(self, n=48, marker=None, fault_at=None):
        self.n, self.marker, self.fault_at = n, marker, fault_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fault_at and get_worker_info() is not None and not Path(self.marker).exists():
            Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def flat(batches):
    """The indices of `batches`, in order."""
    return [i for b in batches for i in torch.as_tensor(b).flatten().tolist()]


def repeated_and_lost(got, n):
    """(extra copies, indices never seen) of `got` against `range(n)`."""
    counts = Counter(got)
    return sum(c - 1 for c in counts.values() if c > 1), n - len(counts)


def shuffled(**kwargs):
    """make_loader's defaults over 48 indices, shuffled from torch's seed 0."""
    torch.manual_seed(0)
    return make_loader(Ids(), batch_size=4, shuffle=True, num_workers=2, **kwargs)


def distributed(**kwargs):
    """Rank 0 of 2 through a shuffled DistributedSampler (seed 0), 12 batches of 2."""
    sampler = DistributedSampler(Ids(), num_replicas=2, rank=0, shuffle=True, seed=0)
    return make_loader(Ids(), batch_size=2, sampler=sampler, num_workers=2, **kwargs)
