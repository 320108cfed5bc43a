"""The early start: `ShardedIterableDataset.set_epoch` (and `make_loader`'s loader) begin the
epoch's first downloads in the main process, before the workers fork. Workers then find the
shards in place or in flight: no object is downloaded twice, no temp file is left behind, and
no worker inherits a lock that a main-process download thread held at the fork."""

import multiprocessing
import os
import time

import numpy as np
import pytest
from torch.utils.data import DataLoader

from recipes.common import PrefetchCache, ShardedIterableDataset, make_loader, worker_init
from recipes.common.remote.prefetch_cache import CacheClosedError
from recipes.common.workers.held_descriptors import held_count
from recipes.testing_servers import LocalHTTPServer

RECORD = 1024
PER_SHARD = 96  # 96 KiB shards: one GET each (below range_bytes)


@pytest.fixture
def shards(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    rng = np.random.default_rng(3)
    names = []
    for s in range(6):
        records = rng.integers(0, 256, (PER_SHARD, RECORD), dtype=np.uint8)
        records[:, 0] = s  # the shard and record number, to check coverage
        records[:, 1] = np.arange(PER_SHARD)
        (folder / f"shard-{s}.bin").write_bytes(records.tobytes())
        names.append(f"shard-{s}.bin")
    return folder, names


def read_records(path):
    data = np.frombuffer(open(path, "rb").read(), np.uint8).reshape(-1, RECORD)
    return [tuple(int(v) for v in row[:2]) for row in data]


def _collate(items):
    return items


def _dataset(server, names, cache):
    return ShardedIterableDataset(
        [server.url(n) for n in names],
        read_records,
        shard_lengths=[PER_SHARD] * len(names),
        seed=1,
        cache=cache,
    )


def _no_temps(cache_dir):
    return [n for n in os.listdir(cache_dir) if n.startswith(".tmp.")]


def test_set_epoch_starts_the_first_download_before_any_worker(tmp_path, shards):
    folder, names = shards
    with LocalHTTPServer(folder, latency=0.05) as server:
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30, prefetch=2, backoff=0.01)
        ds = _dataset(server, names, cache)
        ds.set_epoch(0)
        first = names[int(ds.order(0)[0])]
        deadline = time.monotonic() + 10
        while not cache.path_for(server.url(first)).exists():  # no iteration, no worker yet
            assert time.monotonic() < deadline, "set_epoch started no download"
            time.sleep(0.01)
        assert server.gets[first] == 1


@pytest.mark.parametrize("how", ["dataloader", "make_loader"])
def test_the_early_start_downloads_each_object_once_and_leaves_no_temp(tmp_path, shards, how):
    folder, names = shards
    # 96 KiB at 256 KiB/s: each download is still in flight when the workers fork.
    with LocalHTTPServer(folder, latency=0.05, bandwidth=256 * 1024) as server:
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30, prefetch=3, backoff=0.01)
        ds = _dataset(server, names, cache)
        seen = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            if how == "dataloader":
                loader = DataLoader(
                    ds,
                    batch_size=16,
                    num_workers=2,
                    collate_fn=_collate,
                    worker_init_fn=worker_init,
                    timeout=60,
                )
            else:
                loader = make_loader(
                    ds, batch_size=16, num_workers=2, collate_fn=_collate, timeout=60
                )
            seen.append(sorted(item for batch in loader for item in batch))
        expected = sorted((s, r) for s in range(len(names)) for r in range(PER_SHARD))
        assert seen == [expected, expected]  # every record once per epoch
        assert {n: server.gets[n] for n in names} == dict.fromkeys(
            names, 1
        )  # one GET per object, ever
        assert cache.stats()["misses"] == len(names)
        assert _no_temps(cache.dir) == []


def test_a_worker_never_inherits_a_lock_held_by_a_download_thread(tmp_path, shards, monkeypatch):
    """The main process downloads the first shard, slowly, holding its key's flock while the
    workers fork. The worker that needs that shard waits for the download and reads it. A
    forked copy of the lock's descriptor would hold the flock for the worker's lifetime and
    hang it: this test fails (DataLoader timeout) without the at-fork close."""
    folder, names = shards
    with LocalHTTPServer(folder, bandwidth=96 * 1024) as server:  # 1 s per shard
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30, prefetch=1, backoff=0.01)
        ds = _dataset(server, names, cache)
        ds.set_epoch(0)
        first = server.url(names[int(ds.order(0)[0])])
        deadline = time.monotonic() + 10
        while not held_count():  # the download thread holds the key lock now
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert not cache.path_for(first).exists()
        loader = DataLoader(ds, batch_size=16, num_workers=2, collate_fn=_collate, timeout=30)
        batches = iter(loader)  # the workers fork now, the download still in flight
        server.bandwidth = None  # the rest at full speed
        items = [item for batch in batches for item in batch]
        del batches  # the workers exit while the server still answers their read-ahead
        assert len(items) == len(names) * PER_SHARD
        assert server.gets[names[int(ds.order(0)[0])]] == 1
        assert _no_temps(cache.dir) == []


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="lists descriptors through Linux's /proc"
)
def test_a_fork_during_a_whole_object_download_leaves_the_child_no_descriptor_of_it(
    tmp_path, shards
):
    """A whole-object download (one GET, below `range_bytes`) writes through the descriptor
    the cache opened and registered, closed in the child at fork. Through fsspec's
    `get_file`, which opens its own, the child would hold the temp file open (issue 19)."""
    folder, _ = shards
    data = np.random.default_rng(5).integers(0, 256, 512 * 1024, dtype=np.uint8).tobytes()
    (folder / "whole.bin").write_bytes(data)
    with LocalHTTPServer(folder, bandwidth=512 * 1024) as server:  # 64 KiB every 1/8 s: 1 s in all
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30, prefetch=1, backoff=0.01)
        url = server.url("whole.bin")
        [download] = cache.prefetch([url])
        _wait_for_first_bytes(cache)
        assert not cache.path_for(url).exists()  # in flight at the fork
        targets = _descriptors_of_a_forked_child()
        download.result(timeout=30)
        assert server.gets["whole.bin"] == 1 and not server.range_gets  # the whole-object path
    assert [t for t in targets if t.startswith(f"{cache.dir}/")] == []  # no temp file, no lock
    assert any(
        t.startswith("socket:") or t.startswith("pipe:") for t in targets
    )  # the listing worked
    assert cache.path_for(url).read_bytes() == data and _no_temps(cache.dir) == []


def _wait_for_first_bytes(cache) -> None:
    """Returns once a download of `cache` has written bytes to its temp file."""
    deadline = time.monotonic() + 10
    while not any(os.path.getsize(cache.dir / n) for n in _no_temps(cache.dir)):
        assert time.monotonic() < deadline, "the download wrote nothing"
        time.sleep(0.005)


def _descriptors_of_a_forked_child() -> list[str]:
    """What each open descriptor of a child forked now points at (`/proc/self/fd` links)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then leave without running the parent's cleanup
        try:
            targets = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    targets.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass  # the listing's own descriptor, closed again
            os.write(write_end, "\n".join(targets).encode("utf-8", "surrogateescape"))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        listing = pipe.read().decode("utf-8", "surrogateescape")
    os.waitpid(pid, 0)
    return listing.split("\n")


def _close_in_a_forked_child(cache, url):
    started = time.monotonic()
    cache.close()  # the download thread is the parent's: nothing here to stop or join
    assert time.monotonic() - started < 0.5
    with pytest.raises(CacheClosedError, match="was closed"):
        cache.get(url)


def test_a_forked_child_closes_its_copy_and_leaves_the_parents_download_alone(tmp_path, shards):
    """A DataLoader worker closing the cache it inherited must not join (or stop) threads of
    the parent: they are not in the child, and the parent's downloads go on."""
    folder, _ = shards
    data = np.random.default_rng(6).integers(0, 256, 512 * 1024, dtype=np.uint8).tobytes()
    (folder / "whole.bin").write_bytes(data)
    with LocalHTTPServer(folder, bandwidth=512 * 1024) as server:  # 1 s
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30, prefetch=1, backoff=0.01)
        url = server.url("whole.bin")
        [download] = cache.prefetch([url])
        _wait_for_first_bytes(cache)  # in flight
        child = multiprocessing.get_context("fork").Process(
            target=_close_in_a_forked_child, args=(cache, url)
        )
        child.start()
        child.join(30)
        exitcode = child.exitcode
        child.kill()  # a hung child (one that joins threads it does not own) must not hang the run
        assert exitcode == 0
        assert download.result(timeout=30) is None and cache.path_for(url).read_bytes() == data
        assert server.gets["whole.bin"] == 1
        cache.close()
        assert held_count() == 0 and _no_temps(cache.dir) == []
