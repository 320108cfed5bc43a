"""A mixture seen at a glance (issue 48, point 5): `share_trace`'s realised shares equal the
shares counted from the plan by hand, in samples and tokens; its target follows a step
schedule's switch and a change of weights by the loop; `plot_shares` draws a run's epochs;
`LoaderMonitor`'s row holds the token shares counted from the batches received and the
target at the epoch's end."""

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset

from recipes.common import LoaderMonitor, MixtureSampler, Schedule, make_loader
from recipes.common.sampling.mixture_shares import ShareTrace, plot_shares, share_trace

SIZES = [3000, 2000, 1000]


class Documents(Dataset):
    """Each item: its global id and its length in tokens."""

    def __init__(self, first, lengths):
        self.first = first
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.first + int(i), int(self.lengths[i])


def _collate(items):
    ids, tokens = zip(*items, strict=True)
    return {"id": torch.tensor(ids), "tokens": torch.tensor(tokens)}


def _lengths(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(8, 200, n) for n in SIZES]


def _data(lengths):
    firsts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    return ConcatDataset([Documents(int(f), x) for f, x in zip(firsts, lengths, strict=True)])


def _token_mixture(**settings):
    lengths = _lengths()
    total = int(2 * 4000 * np.mean(np.concatenate(lengths)))
    schedule = Schedule(
        [(0.0, [0.6, 0.4, 0.0]), (0.5, [0.3, 0.3, 0.4])], over="tokens", total=total
    )
    mix = MixtureSampler(
        SIZES, schedule, lengths=lengths, stop="never", num_samples=4000, seed=5, **settings
    )
    return mix, lengths


def _counted(plan, units, sources, end, width):
    """Shares in samples and in units of the samples whose end lies in (end - width, end]."""
    ends = np.cumsum(units)
    inside = (ends > end - width) & (ends <= end)
    samples = np.bincount(sources[inside], minlength=3) / inside.sum()
    tokens = np.bincount(sources[inside], weights=units[inside], minlength=3)
    return samples, tokens / tokens.sum()


def test_realised_shares_are_the_plans_own_counts_in_samples_and_tokens():
    mix, lengths = _token_mixture()
    flat = np.concatenate(lengths)
    for epoch in range(2):
        mix.set_epoch(epoch)
        trace = mix.share_trace(window=20_000, points=25)
        same = share_trace(mix, epoch, window=20_000, points=25)  # the method delegates
        np.testing.assert_array_equal(trace.tokens, same.tokens)
        plan = mix.global_indices(epoch)
        units = flat[plan]
        sources = mix.source_of(plan)
        start = trace.progress[0] - 20_000
        if epoch == 0:
            assert start == 0
        else:  # progress goes on from the previous epoch's end
            assert start == flat[mix.global_indices(0)].sum()
        assert trace.progress[-1] == start + units.sum()
        assert len(trace.progress) == 25
        for p in (0, 11, 24):
            samples, tokens = _counted(plan, units, sources, trace.progress[p] - start, 20_000)
            np.testing.assert_allclose(trace.samples[p], samples)
            np.testing.assert_allclose(trace.tokens[p], tokens)
        assert np.abs(trace.tokens - trace.target).max() < 0.06  # the token shares follow


def test_without_lengths_windows_count_samples_and_tokens_are_none():
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2], seed=2)
    trace = mix.share_trace(window=500, points=10)
    assert trace.tokens is None
    assert trace.names == ["0", "1", "2"]
    plan = mix.global_indices()
    sources = mix.source_of(plan)
    for p, end in enumerate(trace.progress.astype(int)):
        expected = np.bincount(sources[end - 500 : end], minlength=3) / 500
        np.testing.assert_allclose(trace.samples[p], expected)
    np.testing.assert_allclose(trace.target, np.tile([0.5, 0.3, 0.2], (10, 1)))


def test_the_target_follows_a_step_schedules_switch():
    schedule = Schedule([(0.0, [1.0, 0.0]), (0.5, [0.0, 1.0])], total=2000, interpolation="step")
    mix = MixtureSampler([5000, 5000], schedule, stop="never", num_samples=2000)
    trace = mix.share_trace(window=100, points=39)  # window ends every 50 samples
    before = trace.progress <= 1000
    after = trace.progress - 100 >= 1000
    np.testing.assert_allclose(trace.target[before], [[1.0, 0.0]] * before.sum())
    np.testing.assert_allclose(trace.target[after], [[0.0, 1.0]] * after.sum())
    np.testing.assert_allclose(trace.samples, trace.target, atol=0.02)


def test_the_target_follows_weights_set_by_the_loop():
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2], stop="never", num_samples=3000, batch_size=10)
    batches = iter(mix)
    for _ in range(50):
        next(batches)
    position = mix.set_weights([0.1, 0.1, 0.8]) * 10
    trace = mix.share_trace(window=200, points=30)
    before = trace.progress <= position
    after = trace.progress - 200 >= position
    assert before.sum() >= 3 and after.sum() >= 10
    np.testing.assert_allclose(trace.target[before], [[0.5, 0.3, 0.2]] * before.sum())
    np.testing.assert_allclose(trace.target[after], [[0.1, 0.1, 0.8]] * after.sum())
    assert trace.samples[after][:, 2].mean() > 0.7


def test_bad_windows_are_refused():
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2])
    with pytest.raises(ValueError, match="`window` must be a positive integer"):
        mix.share_trace(window=0)
    with pytest.raises(ValueError, match="`points` must be a positive integer"):
        share_trace(mix, points=-1)


def test_plot_shares_draws_a_run_of_epochs(tmp_path):
    pytest.importorskip("matplotlib")
    mix, _ = _token_mixture()
    traces = [mix.share_trace(epoch, window=20_000, points=20) for epoch in range(2)]
    drawn = plot_shares(traces, tmp_path / "shares.png", title="two epochs")
    assert (tmp_path / "shares.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(drawn, ShareTrace) and len(drawn.progress) == 40
    assert (np.diff(drawn.progress) > 0).all()  # the epochs joined along progress
    fixed = MixtureSampler(SIZES, [0.5, 0.3, 0.2])  # no progress across epochs: placed after
    again = plot_shares([fixed.share_trace(0), fixed.share_trace(1)], tmp_path / "fixed.svg")
    assert (np.diff(again.progress) > 0).all()
    with pytest.raises(ValueError, match=".png or .svg"):
        plot_shares(traces, tmp_path / "shares.jpg")


@pytest.mark.parametrize("mode", ["indices", "batches"])
def test_the_monitor_row_has_token_shares_of_the_batches_received(mode):
    mix, lengths = _token_mixture(batch_size=16) if mode == "batches" else _token_mixture()
    settings = {"batch_sampler": mix}
    if mode == "indices":
        settings = {"sampler": mix, "batch_size": 16}
    loader = make_loader(_data(lengths), collate_fn=_collate, num_workers=0, **settings)
    monitor = LoaderMonitor(loader, warn_wait_fraction=1.0)
    for epoch in range(2):
        mix.set_epoch(epoch)
        tokens = np.zeros(3)
        for batch in monitor:
            sources = np.searchsorted(np.cumsum(SIZES), batch["id"].numpy(), side="right")
            tokens += np.bincount(sources, weights=batch["tokens"].numpy(), minlength=3)
        row = monitor.epochs[-1]
        assert list(row["sources_tokens"]) == ["0", "1", "2"]
        np.testing.assert_allclose(list(row["sources_tokens"].values()), tokens / tokens.sum())
        end = mix.share_trace(epoch, window=1, points=1).progress[-1]
        np.testing.assert_allclose(
            list(row["sources_target"].values()), mix.schedule.weights_at([end])[0], atol=1e-6
        )
    assert monitor.summary()["sources_tokens"] == monitor.epochs[-1]["sources_tokens"]


@pytest.mark.parametrize("mode", ["indices", "batches"])
def test_the_monitor_row_after_a_resume_mid_epoch(mode):
    """Batch mode: the tokens of the rest received; index mode: None (the sampler resumed by
    itself from a position the monitor cannot read), never another part's tokens."""
    lengths = _lengths()

    def build():
        mix, _ = _token_mixture(batch_size=16) if mode == "batches" else _token_mixture()
        settings = {"batch_sampler": mix}
        if mode == "indices":
            settings = {"sampler": mix, "batch_size": 16}
        return make_loader(_data(lengths), collate_fn=_collate, num_workers=0, **settings)

    first = build()
    iterator = iter(first)
    for _ in range(40):
        next(iterator)
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    monitor = LoaderMonitor(resumed, warn_wait_fraction=1.0)
    tokens = np.zeros(3)
    for batch in monitor:
        sources = np.searchsorted(np.cumsum(SIZES), batch["id"].numpy(), side="right")
        tokens += np.bincount(sources, weights=batch["tokens"].numpy(), minlength=3)
    row = monitor.epochs[-1]
    assert row["samples"] == 4000 - 40 * 16
    if mode == "indices":
        assert row["sources_tokens"] is None
    else:
        np.testing.assert_allclose(list(row["sources_tokens"].values()), tokens / tokens.sum())


def test_the_monitor_row_has_no_token_shares_without_lengths():
    mix = MixtureSampler(SIZES, [0.5, 0.3, 0.2], seed=1, batch_size=32)
    loader = make_loader(_data(_lengths()), batch_sampler=mix, collate_fn=_collate)
    monitor = LoaderMonitor(loader, warn_wait_fraction=1.0)
    for _ in monitor:
        pass
    row = monitor.epochs[-1]
    assert row["sources_tokens"] is None
    assert row["sources_target"] == pytest.approx({"0": 0.5, "1": 0.3, "2": 0.2})
