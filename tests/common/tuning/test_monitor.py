import json
import os
import signal
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.common import (
    LoaderMonitor,
    LoaderWarning,
    PrefetchCache,
    ShardedIterableDataset,
    profile_trace,
)
from recipes.testing_servers import LocalHTTPServer


class Sleepy(Dataset):
    """Items that take `fetch` seconds each (`slow_index` takes `slow` seconds)."""

    def __init__(self, n=24, fetch=0.0, slow_index=None, slow=0.0, leak_bytes=0, kill_at=None):
        self.n, self.fetch, self.slow_index, self.slow = n, fetch, slow_index, slow
        self.leak_bytes, self.kill_at = leak_bytes, kill_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.leak_bytes:  # a per-worker cache without a bound
            _LEAK.append(bytearray(os.urandom(self.leak_bytes)))
        time.sleep(self.slow if i == self.slow_index else self.fetch)
        return torch.tensor([i])


_LEAK: list = []


def _run(monitor, step_seconds=0.0, epochs=1):
    seen = []
    for _ in range(epochs):
        for batch in monitor:
            seen.extend(batch.flatten().tolist() if isinstance(batch, torch.Tensor) else [batch])
            time.sleep(step_seconds)
    return seen


def _loader_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, LoaderWarning)]


def test_wait_fraction_matches_the_fetch_and_step_times():
    # 4 items x 10 ms fetched in the main process, then a 40 ms step: 50% of the time waiting.
    monitor = LoaderMonitor(DataLoader(Sleepy(24, fetch=0.01), batch_size=4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        seen = _run(monitor, step_seconds=0.04)
    summary = monitor.summary()
    assert seen == list(range(24))
    assert summary["batches"] == 6 and summary["samples"] == 24 and summary["epochs"] == 1
    assert 0.40 < summary["wait_fraction"] < 0.60
    assert summary["samples_per_s"] == pytest.approx(24 / summary["seconds"])
    assert summary["max_batch_s"] >= 0.04
    assert any("waited for data" in m and "recipes tune" in m for m in _loader_warnings(record))


def test_no_warning_when_the_step_dominates():
    monitor = LoaderMonitor(DataLoader(Sleepy(16, fetch=0.001), batch_size=4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(monitor, step_seconds=0.05, epochs=2)
    summary = monitor.summary()
    assert summary["wait_fraction"] < 0.2 and summary["epochs"] == 2 and summary["batches"] == 8
    assert _loader_warnings(record) == []
    assert summary["gpu_util"] is None or torch.cuda.is_available()


def test_a_slow_batch_is_named_with_its_time():
    monitor = LoaderMonitor(
        DataLoader(Sleepy(12, slow_index=9, slow=0.35), batch_size=3),
        warn_batch_seconds=0.2,
        warn_wait_fraction=0.99,
    )
    with pytest.warns(LoaderWarning, match=r"a batch took 0\.3\d s to arrive \(threshold 0\.20 s"):
        _run(monitor)
    assert monitor.summary()["max_batch_s"] >= 0.35
    assert monitor.summary()["batch_time_cv"] > 1.0


def test_worker_memory_growth_between_epochs_warns():
    leaky = DataLoader(
        Sleepy(16, leak_bytes=4 << 20), batch_size=2, num_workers=2, persistent_workers=True
    )
    monitor = LoaderMonitor(leaky, sample_seconds=0.001, warn_wait_fraction=0.99)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(monitor, epochs=3)
    warm_up, first, second = monitor.epochs
    assert (
        warm_up["memory_growth"] is None and first["memory_growth"] is None
    )  # judged from epoch 2 on
    assert second["memory_growth"] > 0.2
    assert first["workers"] == 2 and first["workers_uss_bytes"] > 0
    assert len(first["per_worker"]) == 2 and all(w["uss_bytes"] > 0 for w in first["per_worker"])
    assert sum(w["uss_bytes"] for w in first["per_worker"]) >= first["workers_uss_bytes"]
    assert second["workers_uss_bytes"] > first["workers_uss_bytes"] + 16 * (4 << 20) * 0.5
    assert any("memory grew" in m and "PackedStrings" in m for m in _loader_warnings(record))

    steady = DataLoader(Sleepy(16), batch_size=2, num_workers=2, persistent_workers=True)
    control = LoaderMonitor(steady, sample_seconds=0.001, warn_wait_fraction=0.99)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(control, epochs=3)
    assert not any("memory grew" in m for m in _loader_warnings(record))


def test_a_killed_worker_is_counted_and_explained():
    loader = DataLoader(Sleepy(40, fetch=0.01, kill_at=17), batch_size=2, num_workers=2, timeout=60)
    monitor = LoaderMonitor(loader, warn_wait_fraction=0.99)
    with (
        pytest.warns(LoaderWarning, match="out-of-memory killer"),
        pytest.raises(RuntimeError, match="exited"),
    ):
        _run(monitor)
    assert monitor.summary()["worker_deaths"] == 1
    assert monitor.epochs[0]["worker_exit_codes"] == [-signal.SIGKILL]


def test_prefetch_cache_traffic_is_reported(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    for s in range(4):
        (remote / f"s{s}.bin").write_bytes(bytes(range(10)) * 1000)
    with LocalHTTPServer(remote) as server:
        cache = PrefetchCache(tmp_path / "cache", max_bytes=1 << 20, prefetch=2)
        urls = [server.url(f"s{s}.bin") for s in range(4)]
        ds = ShardedIterableDataset(urls, lambda path: [path.stat().st_size], cache=cache)
        monitor = LoaderMonitor(
            DataLoader(ds, batch_size=None, num_workers=1), warn_wait_fraction=0.99
        )
        _run(monitor, epochs=2)
    first, second = (e["prefetch"] for e in monitor.epochs)
    assert first["misses"] == 4 and first["bytes_downloaded"] == 4 * 10_000
    assert second["misses"] == 0 and second["hits"] >= 4
    assert monitor.summary()["prefetch"] == second
    assert "| 1 |" in monitor.report()


def test_the_monitor_stands_in_for_the_loader():
    loader = DataLoader(Sleepy(10), batch_size=4)
    monitor = LoaderMonitor(loader)
    assert len(monitor) == 3 and monitor.dataset is loader.dataset and monitor.batch_size == 4
    with pytest.raises(
        ValueError, match="`warn_wait_fraction` must be positive, but is 0 instead."
    ):
        LoaderMonitor(loader, warn_wait_fraction=0)
    assert monitor.summary()["batches"] == 0


def test_profile_trace_marks_data_fetches(tmp_path):
    steps = []
    path = profile_trace(
        DataLoader(Sleepy(20), batch_size=4),
        tmp_path / "t" / "trace.json",
        steps=3,
        step=steps.append,
    )
    events = json.loads(path.read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    assert names.count("data_fetch") == 3 and names.count("train_step") == 3
    assert len(steps) == 3


def test_breaking_out_early_still_records_the_epoch():
    monitor = LoaderMonitor(
        DataLoader(Sleepy(40, fetch=0.002), batch_size=4), warn_wait_fraction=0.99
    )
    for i, _ in enumerate(monitor):
        if i == 4:
            break
    assert len(monitor.epochs) == 1 and monitor.summary()["batches"] == 5
    assert monitor.summary()["steady_samples_per_s"] > 0
