import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from recipes.bench.common import PathsDataset, _fake_paths
from recipes.common import PackedStrings, measure_worker_memory_growth


@given(st.lists(st.text()))
def test_round_trips_any_strings(strings):
    packed = PackedStrings(strings)
    assert len(packed) == len(strings)
    assert list(packed) == strings
    assert packed == strings
    if strings:
        assert packed[-1] == strings[-1]


def test_indexing_slicing_and_errors():
    packed = PackedStrings(["a/1.jpg", "ß/ü.jpg", "", "c/3.png"])
    assert packed[1] == "ß/ü.jpg" and packed[2] == "" and packed[-1] == "c/3.png"
    assert list(packed[1:3]) == ["ß/ü.jpg", ""]
    assert list(packed[::-2]) == ["c/3.png", "ß/ü.jpg"]
    with pytest.raises(IndexError, match="out of range"):
        packed[4]
    assert packed.data.dtype == np.uint8 and packed.offsets.dtype == np.int64


def test_non_utf8_file_names_round_trip():
    name = b"bad\xff.jpg".decode("utf-8", "surrogateescape")  # as os.listdir returns it
    assert PackedStrings([name])[0] == name


def test_pickles_with_its_buffers():
    packed = PackedStrings(f"x/{i}" for i in range(1000))
    clone = pickle.loads(pickle.dumps(packed))
    assert clone == packed and clone[999] == "x/999"


def test_from_buffers_checks_consistency():
    packed = PackedStrings(["ab", "c"])
    assert PackedStrings.from_buffers(packed.data, packed.offsets) == ["ab", "c"]
    with pytest.raises(ValueError, match="do not belong together"):
        PackedStrings.from_buffers(packed.data[:-1], packed.offsets)


def test_copy_on_read_is_avoided_in_forked_workers():
    """A million paths: a Python list grows each forked worker's USS, PackedStrings does not."""
    paths = _fake_paths(1_000_000)
    list_growth = measure_worker_memory_growth(PathsDataset(paths), num_workers=2)
    packed_growth = measure_worker_memory_growth(PathsDataset(PackedStrings(paths)), num_workers=2)
    list_mean = sum(list_growth) / 2
    packed_mean = sum(packed_growth) / 2
    # The list's str objects are ~80 MB; each worker touches half of them.
    assert list_mean > 20 * 2**20, list_growth
    assert packed_mean * 10 < list_mean, (list_growth, packed_growth)


def test_index_resolution_shared_by_the_datasets():
    from recipes.common.packed_strings import resolve_index, resolve_indices

    assert resolve_index(-1, 5, "x") == 4
    assert resolve_indices([0, -1, 4], 5, "x").tolist() == [0, 4, 4]
    for bad in (5, -6):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for the 5 things"):
            resolve_indices([0, bad], 5, "the 5 things")
        with pytest.raises(IndexError, match=f"index {bad} is out of range"):
            resolve_index(bad, 5, "the 5 things")


def test_a_folder_build_publishes_whole_or_not_at_all(tmp_path):
    import json

    from recipes.common.cache_files import FolderBuild

    target = tmp_path / "cache"
    build = FolderBuild(target)
    def missing():
        raise KeyError("no cache")

    assert build.needed(missing, KeyError) and not FolderBuild(target).needed(lambda: None, KeyError)
    with pytest.raises(RuntimeError, match="disk on fire"), build:
        (build.path / "data.bin").write_bytes(b"half")
        raise RuntimeError("disk on fire")
    assert list(tmp_path.iterdir()) == []  # nothing published, temp folder removed
    with FolderBuild(target) as build:
        build.part("data.bin").write_bytes(b"new")
        build.concat("data.bin")
        build.publish({"format": "x", "version": 1})
    assert sorted(p.name for p in target.iterdir()) == ["data.bin", "header.json"]
    assert (target / "data.bin").read_bytes() == b"new" and json.loads((target / "header.json").read_text())["format"] == "x"
    with FolderBuild(target) as build:  # a rebuild replaces the folder, leaving nothing of the old one
        (build.path / "other.bin").write_bytes(b"2")
        build.publish({"format": "x", "version": 2})
    assert sorted(p.name for p in target.iterdir()) == ["header.json", "other.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_dead_builders_temps_are_swept_live_and_foreign_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from recipes.common.cache_files import _host, sweep_dead_temps

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    names = {"dead": f".c.{_host()}.{dead}.x.tmp", "live": f".c.{_host()}.{os.getpid()}.y.tmp",
             "other host": f".c.elsewhere.{dead}.z.tmp", "other cache": f".d.{_host()}.{dead}.w.tmp"}
    for name in names.values():
        (tmp_path / name).mkdir()
    assert sweep_dead_temps(tmp_path, "c") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")


def test_a_lazy_map_reopens_per_process_and_pickles_as_its_path(tmp_path):
    import pickle

    from torch.utils.data import DataLoader

    from recipes.common.cache_files import LazyMap

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
    with pytest.raises(ValueError, match=r"16 bytes at byte 7,992 runs past the end of .*d\.bin \(8,000 bytes\)"):
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
    import pickle

    from recipes.common.cache_files import CacheFileError, LazyMap

    _data_file(tmp_path / "d.bin")
    lazy = LazyMap(tmp_path / "d.bin", "<i8", (1000,), error=_CacheError)
    default = LazyMap(tmp_path / "d.bin", "<i8", (1000,))
    os.truncate(tmp_path / "d.bin", 6000)  # a cleanup elsewhere, after the cache was opened
    message = r"d\.bin changed after the cache was opened: truncated in place; it is 6,000 bytes, expected 8,000\. " \
              r"Reopen the cache"
    with pytest.raises(_CacheError, match=message):
        _ = lazy.array
    with pytest.raises(_CacheError, match=message):  # a worker's copy, and the pread path
        pickle.loads(pickle.dumps(lazy)).read_into(np.empty(1, "<i8"), 0)
    with pytest.raises(CacheFileError, match=message):
        _ = default.array
    assert issubclass(CacheFileError, ValueError)  # what numpy raised before: old handlers still catch it


def test_a_short_read_raises_never_returns_a_half_filled_buffer(tmp_path):
    import os

    from recipes.common.cache_files import LazyMap

    _data_file(tmp_path / "d.bin")
    lazy = LazyMap(tmp_path / "d.bin", "<i8", (1000,), error=_CacheError)
    assert lazy.read_into(np.empty(2, "<i8"), 8 * 500).tolist() == [500, 501]  # the descriptor is open now
    os.truncate(tmp_path / "d.bin", 8 * 501)
    out = np.full(2, -1, "<i8")
    with pytest.raises(_CacheError, match=r"d\.bin changed .*truncated in place \(a short read at byte 4,008\); "
                                          r"it is 4,008 bytes, expected 8,000"):
        lazy.read_into(out, 8 * 500)
    rows = [np.empty(1, "<i8") for _ in range(600)]  # one preadv over many buffers
    with pytest.raises(_CacheError, match="short read"):
        lazy.read_into(rows, 0)


def test_a_replaced_file_is_served_whole_where_mapped_and_refused_where_not(tmp_path):
    """An atomic rebuild renames a new file over the old one. A process that mapped the old
    file keeps its inode; one that maps after the rebuild (a worker started later) would mix
    new data with the old offsets, so it raises instead, even when the sizes are equal."""
    import os
    import pickle

    from recipes.common.cache_files import LazyMap

    old = _data_file(tmp_path / "d.bin")
    mapped = LazyMap(tmp_path / "d.bin", "<i8", (1000,), error=_CacheError)
    assert mapped.array[7] == 7
    later = pickle.loads(pickle.dumps(mapped))  # a spawned worker's copy: not mapped yet
    (tmp_path / "new.bin").write_bytes((old + 5000).tobytes())  # the same size
    os.replace(tmp_path / "new.bin", tmp_path / "d.bin")
    assert np.array_equal(mapped.array, old)  # the old inode, whole
    with pytest.raises(_CacheError, match=r"d\.bin changed after the cache was opened: replaced by another file "
                                          r"\(a rebuild .*\); it is 8,000 bytes, expected 8,000\. Reopen"):
        _ = later.array
    with pytest.raises(_CacheError, match="replaced"):
        later.read_into(np.empty(1, "<i8"), 0)
    assert LazyMap(tmp_path / "d.bin", "<i8", (1000,)).array[7] == 5007  # reopened: the new file
    os.unlink(tmp_path / "d.bin")
    with pytest.raises(_CacheError, match=r"d\.bin was removed after the cache was opened; rebuild"):
        _ = pickle.loads(pickle.dumps(mapped)).array
