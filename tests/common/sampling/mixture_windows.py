"""Shared checks of a scheduled mixture's token shares, counted from what a loop received: a
3-source corpus with long-tailed lengths, a 3-phase token schedule over it, and the worst
deviation of any window of the received token stream from the schedule's average there."""

from __future__ import annotations

import numpy as np
from torch.utils.data import ConcatDataset, Dataset

from recipes.common import MixtureSampler, Schedule

NAMES = ("web", "code", "books")


class Documents(Dataset):
    """Each item: its global id and a token array of the given length (what a loop counts)."""

    def __init__(self, first, lengths):
        self.first = first
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"id": self.first + int(i), "tokens": np.zeros(int(self.lengths[i]), np.int32)}


def collate_items(items):
    return items


def corpus(sizes, seed=0):
    """Long-tailed lengths in [8, 512] per source, and the sources as one ConcatDataset."""
    rng = np.random.default_rng(seed)
    lengths = [np.minimum((rng.pareto(1.3, n) + 1) * 24, 512).astype(np.int64) for n in sizes]
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    data = ConcatDataset([Documents(int(f), x) for f, x in zip(firsts, lengths, strict=True)])
    return lengths, data


def three_phases(total: int) -> Schedule:
    """Books absent at first, then a little, then the largest share."""
    return Schedule(
        [
            (0.0, {"web": 0.8, "code": 0.2}),
            (0.3, {"web": 0.6, "code": 0.3, "books": 0.1}),
            (0.8, {"web": 0.3, "code": 0.3, "books": 0.4}),
        ],
        over="tokens",
        total=total,
    )


def scheduled_mixture(sizes, lengths, *, num_samples, epochs, seed=3):
    """A 3-phase token schedule over `epochs` epochs of `num_samples` samples (one rank)."""
    total = int(epochs * num_samples * np.mean(np.concatenate(lengths)))
    return MixtureSampler(
        dict(zip(NAMES, sizes, strict=True)),
        three_phases(total),
        lengths=dict(zip(NAMES, lengths, strict=True)),
        stop="never",
        num_samples=num_samples,
        seed=seed,
        num_replicas=1,
        rank=0,
    )


def window_shares(tokens, sources, width):
    """(start, end, shares) of consecutive windows of `width` tokens of the received stream."""
    cum = np.cumsum(tokens)
    out = []
    for start in range(0, int(cum[-1]) - width + 1, width):
        lo, hi = np.searchsorted(cum, [start, start + width], side="right")
        part = tokens[lo:hi]
        shares = np.bincount(sources[lo:hi], weights=part, minlength=3) / part.sum()
        out.append((int(cum[lo] - tokens[lo]), int(cum[hi - 1]), shares))
    return out


def worst_deviation(windows, mix) -> float:
    """The largest gap of a window's share from the schedule's average over its progress."""
    worst = 0.0
    for start, end, shares in windows:
        target = mix.schedule.weights_at(np.linspace(start, end, 101)).mean(axis=0)
        worst = max(worst, float(np.abs(shares - target).max()))
    return worst
