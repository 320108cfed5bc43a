"""The cache-file protocol (common/caches/cache_files.py): atomic folder builds, dead builders'
temps, memory maps that refuse a file changed under them."""

import pickle
import time

import numpy as np
import pytest


def test_a_folder_build_publishes_whole_or_not_at_all(tmp_path):
    import json

    from recipes.common.caches.cache_builds import FolderBuild

    target = tmp_path / "cache"
    build = FolderBuild(target)

    def missing():
        raise KeyError("no cache")

    assert build.needed(missing, KeyError) and not FolderBuild(target).needed(
        lambda: None, KeyError
    )
    with pytest.raises(RuntimeError, match="disk on fire"), build:
        (build.path / "data.bin").write_bytes(b"half")
        raise RuntimeError("disk on fire")
    assert list(tmp_path.iterdir()) == []  # nothing published, temp folder removed
    with FolderBuild(target) as build:
        build.part("data.bin").write_bytes(b"new")
        build.concat("data.bin")
        build.publish({"format": "x", "version": 1})
    assert sorted(p.name for p in target.iterdir()) == ["data.bin", "header.json"]
    assert (target / "data.bin").read_bytes() == b"new" and json.loads(
        (target / "header.json").read_text()
    )["format"] == "x"
    with FolderBuild(
        target
    ) as build:  # a rebuild replaces the folder, leaving nothing of the old one
        (build.path / "other.bin").write_bytes(b"2")
        build.publish({"format": "x", "version": 2})
    assert sorted(p.name for p in target.iterdir()) == ["header.json", "other.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_the_first_of_two_builders_to_publish_wins(tmp_path):
    """Two processes found no cache and built it. The second to publish keeps the first's
    folder (a reader has it open, and may be adding an eval view to it) and deletes its own;
    a folder that does not open as a valid cache is replaced."""
    import json

    from recipes.common.caches.cache_builds import FolderBuild

    target = tmp_path / "cache"

    def open_cache():
        if json.loads((target / "header.json").read_text())["version"] != 1:
            raise KeyError("stale")

    first, second = FolderBuild(target), FolderBuild(target)
    assert first.needed(lambda: open_cache(), (KeyError, OSError))
    assert second.needed(lambda: open_cache(), (KeyError, OSError))
    with first, second:
        (first.path / "data.bin").write_bytes(b"first")
        (second.path / "data.bin").write_bytes(b"second")
        first.publish({"version": 1})
        (target / "eval-view.bin").write_bytes(b"added by the first builder's process")
        second.publish({"version": 1})
    assert sorted(p.name for p in target.iterdir()) == ["data.bin", "eval-view.bin", "header.json"]
    assert (target / "data.bin").read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # the second's temp folder is gone

    (target / "header.json").write_text(json.dumps({"version": 0}))  # stale: replaced
    third = FolderBuild(target)
    assert third.needed(lambda: open_cache(), (KeyError, OSError))
    with third:
        (third.path / "data.bin").write_bytes(b"third")
        third.publish({"version": 1})
    assert sorted(p.name for p in target.iterdir()) == ["data.bin", "header.json"]
    assert (target / "data.bin").read_bytes() == b"third"
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_dead_builders_temps_are_swept_live_and_foreign_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from recipes.common.caches.cache_builds import sweep_dead_temps
    from recipes.common.caches.cache_files import _host

    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )
    names = {
        "dead": f".c.{_host()}.{dead}.x.tmp",
        "live": f".c.{_host()}.{os.getpid()}.y.tmp",
        "other host": f".c.elsewhere.{dead}.z.tmp",
        "other cache": f".d.{_host()}.{dead}.w.tmp",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    assert sweep_dead_temps(tmp_path, "c") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        v for k, v in names.items() if k != "dead"
    )

    from recipes.common.caches.cache_builds import FolderBuild

    (tmp_path / "c").mkdir()  # a valid cache: no build follows, but its dead builders' temps go
    (tmp_path / names["dead"]).mkdir()
    assert not FolderBuild(tmp_path / "c").needed(lambda: None, KeyError)
    assert not (tmp_path / names["dead"]).exists() and (tmp_path / names["live"]).exists()


def test_a_lazy_map_reopens_per_process_and_pickles_as_its_path(tmp_path):

    from torch.utils.data import DataLoader

    from recipes.common.caches.cache_files import LazyMap

    data = np.arange(1000, dtype="<i8")
    (tmp_path / "d.bin").write_bytes(data.tobytes())
    lazy = LazyMap(tmp_path / "d.bin", "<i8", (1000,))
    assert lazy.array[999] == 999
    state = pickle.loads(pickle.dumps(lazy)).__dict__
    assert state["_array"] is None and state["_fd"] is None  # the map never travels
    out = np.empty(3, "<i8")
    assert lazy.read_into(out, 8 * 10).tolist() == [10, 11, 12]

    class Items:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return int(lazy.array[i * 100]) + int(lazy.read_into(np.empty(1, "<i8"), 8 * i)[0])

    got = sorted(int(x) for x in DataLoader(Items(), batch_size=None, num_workers=2))
    assert got == [0, 101, 202, 303]
    with pytest.raises(
        ValueError, match=r"16 bytes at byte 7,992 runs past the end of .*d\.bin \(8,000 bytes\)"
    ):
        lazy.read_into(np.empty(2, "<i8"), 8 * 999)  # the file is whole: the request is wrong


class _CacheError(ValueError):
    pass


def _data_file(path, n=1000):
    data = np.arange(n, dtype="<i8")
    path.write_bytes(data.tobytes())
    return data


def test_a_file_truncated_in_place_before_first_use_raises_the_caches_error(tmp_path):
    """Numpy would say "mmap length is greater than file size", naming nothing (issue 19)."""
    import os

    from recipes.common.caches.cache_files import CacheFileError, LazyMap

    _data_file(tmp_path / "d.bin")
    lazy = LazyMap(tmp_path / "d.bin", "<i8", (1000,), error=_CacheError)
    default = LazyMap(tmp_path / "d.bin", "<i8", (1000,))
    os.truncate(tmp_path / "d.bin", 6000)  # a cleanup elsewhere, after the cache was opened
    message = (
        r"d\.bin changed after the cache was opened: truncated in place; it is 6,000 bytes, "
        r"expected 8,000\. "
        r"Reopen the cache"
    )
    with pytest.raises(_CacheError, match=message):
        _ = lazy.array
    with pytest.raises(_CacheError, match=message):  # a worker's copy, and the pread path
        pickle.loads(pickle.dumps(lazy)).read_into(np.empty(1, "<i8"), 0)
    with pytest.raises(CacheFileError, match=message):
        _ = default.array
    assert issubclass(
        CacheFileError, ValueError
    )  # what numpy raised before: old handlers still catch it


def test_a_short_read_raises_never_returns_a_half_filled_buffer(tmp_path):
    import os

    from recipes.common.caches.cache_files import LazyMap

    _data_file(tmp_path / "d.bin")
    lazy = LazyMap(tmp_path / "d.bin", "<i8", (1000,), error=_CacheError)
    assert lazy.read_into(np.empty(2, "<i8"), 8 * 500).tolist() == [
        500,
        501,
    ]  # the descriptor is open now
    os.truncate(tmp_path / "d.bin", 8 * 501)
    out = np.full(2, -1, "<i8")
    with pytest.raises(
        _CacheError,
        match=r"d\.bin changed .*truncated in place \(a short read at byte 4,008\); "
        r"it is 4,008 bytes, expected 8,000",
    ):
        lazy.read_into(out, 8 * 500)
    rows = [np.empty(1, "<i8") for _ in range(600)]  # one preadv over many buffers
    with pytest.raises(_CacheError, match="short read"):
        lazy.read_into(rows, 0)


def test_a_replaced_file_is_served_whole_where_mapped_and_refused_where_not(tmp_path):
    """An atomic rebuild renames a new file over the old one. A process that mapped the old
    file keeps its inode; one that maps after the rebuild (a worker started later) would mix
    new data with the old offsets, so it raises instead, even when the sizes are equal."""
    import os

    from recipes.common.caches.cache_files import LazyMap

    old = _data_file(tmp_path / "d.bin")
    mapped = LazyMap(tmp_path / "d.bin", "<i8", (1000,), error=_CacheError)
    assert mapped.array[7] == 7
    later = pickle.loads(pickle.dumps(mapped))  # a spawned worker's copy: not mapped yet
    (tmp_path / "new.bin").write_bytes((old + 5000).tobytes())  # the same size
    os.replace(tmp_path / "new.bin", tmp_path / "d.bin")
    assert np.array_equal(mapped.array, old)  # the old inode, whole
    with pytest.raises(
        _CacheError,
        match=r"d\.bin changed after the cache was opened: replaced by another file "
        r"\(a rebuild .*\); it is 8,000 bytes, expected 8,000\. Reopen",
    ):
        _ = later.array
    with pytest.raises(_CacheError, match="replaced"):
        later.read_into(np.empty(1, "<i8"), 0)
    assert LazyMap(tmp_path / "d.bin", "<i8", (1000,)).array[7] == 5007  # reopened: the new file
    os.unlink(tmp_path / "d.bin")
    with pytest.raises(
        _CacheError, match=r"d\.bin was removed after the cache was opened; rebuild"
    ):
        _ = pickle.loads(pickle.dumps(mapped)).array


def test_a_publisher_never_swaps_away_a_cache_published_after_its_check(tmp_path):
    """B finds the old cache invalid; before B swaps, A publishes a valid one. Without the
    folder lock around check and swap, B moved A's published cache aside and deleted it (A had
    returned True, and a reader of A's folder lost it). With it, A waits for B, then keeps B's."""
    import json
    import threading

    from recipes.common.caches.cache_files import replace_dir

    target = tmp_path / "cache"
    target.mkdir()
    (target / "header.json").write_text(json.dumps({"valid": False}))  # a stale cache

    def valid() -> bool:
        try:
            return json.loads((target / "header.json").read_text())["valid"]
        except (OSError, ValueError):
            return False

    checked = threading.Event()

    def slow_valid() -> bool:  # B's check: it answers, then B is descheduled for a while
        answer = valid()
        checked.set()
        time.sleep(0.5)
        return answer

    builds = {}
    for name in ("a", "b"):
        builds[name] = tmp_path / f".cache.{name}.tmp"
        builds[name].mkdir()
        (builds[name] / "header.json").write_text(json.dumps({"valid": True, "by": name}))
    results = {}
    b = threading.Thread(
        target=lambda: results.update(b=replace_dir(builds["b"], target, keep=slow_valid))
    )
    b.start()
    checked.wait(5)
    results["a"] = replace_dir(
        builds["a"], target, keep=valid
    )  # A publishes while B sits between check and swap
    b.join()
    final = json.loads((target / "header.json").read_text())["by"]
    winners = [name for name, published in results.items() if published]
    assert winners == [final], (results, final)  # whoever returned True is what stayed
    assert final == "b" and results == {
        "a": False,
        "b": True,
    }  # A waited for B's swap, then kept B's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
