"""PrefetchCache's ranged downloads: concurrent ranges of one object against a real HTTP
server, each retried on its own, assembled exactly, never served partial."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from recipes.common import PrefetchCache
from recipes.testing import LocalHTTPServer

RANGE = 256 * 1024


@pytest.fixture
def big(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    data = np.random.default_rng(7).integers(0, 256, 10 * RANGE + 12_345, dtype=np.uint8).tobytes()
    (folder / "big.bin").write_bytes(data)
    return folder, data


def _cache(tmp_path, **kw):
    return PrefetchCache(tmp_path / "cache", max_bytes=2**30, backoff=0.01, range_bytes=RANGE,
                         range_connections=4, **kw)


def _ranges(server):
    return sorted(start for (path, start), n in server.range_gets.items() if path == "big.bin" for _ in range(n))


def test_ranges_finishing_out_of_order_assemble_the_exact_bytes(tmp_path, big):
    folder, data = big
    with LocalHTTPServer(folder) as server:
        server.delay_range = {0: 0.4, RANGE: 0.2}  # the first ranges land last
        path = _cache(tmp_path).get(server.url("big.bin"))
        assert path.read_bytes() == data
        assert _ranges(server) == list(range(0, len(data), RANGE))  # 11 ranges, each once
        assert server.gets["big.bin"] == 11  # no whole-object GET


def test_a_range_failing_twice_is_retried_alone(tmp_path, big):
    folder, data = big
    with LocalHTTPServer(folder) as server:
        server.fail_range = {3 * RANGE: 2}
        assert _cache(tmp_path).get(server.url("big.bin")).read_bytes() == data
        assert server.range_gets[("big.bin", 3 * RANGE)] == 3
        assert all(n == 1 for (_, start), n in server.range_gets.items() if start != 3 * RANGE)


def test_a_short_range_is_retried_never_cached(tmp_path, big):
    folder, data = big
    with LocalHTTPServer(folder) as server:
        server.short_range = {5 * RANGE: 1}
        assert _cache(tmp_path).get(server.url("big.bin")).read_bytes() == data
        assert server.range_gets[("big.bin", 5 * RANGE)] == 2


def test_small_objects_take_one_request(tmp_path, big):
    folder, data = big
    (folder / "small.bin").write_bytes(data[:RANGE])
    with LocalHTTPServer(folder) as server:
        assert _cache(tmp_path).get(server.url("small.bin")).read_bytes() == data[:RANGE]
        assert server.gets["small.bin"] == 1 and not server.range_gets


KILL_SCRIPT = textwrap.dedent(f"""
    import sys
    from recipes.common import PrefetchCache
    PrefetchCache(sys.argv[1], max_bytes=2**30, range_bytes={RANGE}, range_connections=4).get(sys.argv[2])
""")


def test_sigkill_mid_ranged_download_leaves_no_final_file(tmp_path, big):
    folder, data = big
    cache_dir = tmp_path / "cache"
    with LocalHTTPServer(folder, bandwidth=200_000) as server:  # ~1.3 s per range
        url = server.url("big.bin")
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(cache_dir), url])
        deadline = time.time() + 60
        while sum(server.range_gets.values()) < 4:  # ranges in flight
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert [p for p in cache_dir.iterdir() if p.name.startswith(".tmp")], "the dead downloader's temp file"
        server.bandwidth = None
        cache = PrefetchCache(cache_dir, max_bytes=2**30, range_bytes=RANGE)  # sweeps it
        assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp")]
        assert not cache.path_for(url).exists()
        assert cache.get(url).read_bytes() == data


RACE_SCRIPT = textwrap.dedent(f"""
    import hashlib, sys
    from recipes.common import PrefetchCache
    cache = PrefetchCache(sys.argv[1], max_bytes=2**30, range_bytes={RANGE}, range_connections=4)
    print(hashlib.sha256(cache.get(sys.argv[2]).read_bytes()).hexdigest())
""")


def test_two_processes_send_one_set_of_range_requests(tmp_path, big):
    folder, data = big
    with LocalHTTPServer(folder, latency=0.05, bandwidth=2_000_000) as server:
        url = server.url("big.bin")
        procs = [subprocess.Popen([sys.executable, "-c", RACE_SCRIPT, str(tmp_path / "cache"), url],
                                  stdout=subprocess.PIPE, text=True) for _ in range(2)]
        digests = [p.communicate(timeout=120)[0].strip() for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
        assert set(digests) == {hashlib.sha256(data).hexdigest()}
        assert _ranges(server) == list(range(0, len(data), RANGE))  # counted at the server: one set
