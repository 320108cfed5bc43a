"""PackedStrings and the index checks the datasets share (common/caches/packed_strings.py)."""

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
    """300,000 paths: a Python list grows each forked worker's USS, PackedStrings does not
    (`recipes bench common` shows the million-path figures)."""
    paths = _fake_paths(300_000)
    list_growth = measure_worker_memory_growth(PathsDataset(paths), num_workers=2)
    packed_growth = measure_worker_memory_growth(PathsDataset(PackedStrings(paths)), num_workers=2)
    list_mean = sum(list_growth) / 2
    packed_mean = sum(packed_growth) / 2
    # The list's str objects are ~24 MB; each worker touches half of them (measured 14 MiB).
    assert list_mean > 6 * 2**20, list_growth
    assert packed_mean * 10 < list_mean, (list_growth, packed_growth)


def test_index_resolution_shared_by_the_datasets():
    from recipes.common.caches.packed_strings import resolve_index, resolve_indices

    assert resolve_index(-1, 5, "x") == 4
    assert resolve_indices([0, -1, 4], 5, "x").tolist() == [0, 4, 4]
    for bad in (5, -6):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for the 5 things"):
            resolve_indices([0, bad], 5, "the 5 things")
        with pytest.raises(IndexError, match=f"index {bad} is out of range"):
            resolve_index(bad, 5, "the 5 things")
