import pytest

from recipes.common import PROFILES, Resources, profile_settings
from recipes.common.sizing.resources import GiB


def _res(cpus=32, memory_gib=256, gpus=8):
    return Resources(
        cpus=cpus,
        cpus_logical=cpus,
        memory_available=memory_gib * GiB,
        memory_limit=None,
        shm_bytes=64 * GiB,
        shm_free=64 * GiB,
        gpus=gpus,
        nofile_limit=65536,
    )


BIG = _res()


def test_debug():
    s = profile_settings("debug", BIG, cuda_available=True, local_world_size=1).settings
    assert s == {"num_workers": 0, "batch_size": 32, "pin_memory": False}


def test_production_on_a_gpu_node():
    r = profile_settings("production", BIG, cuda_available=True, local_world_size=1)
    assert r.settings == {
        "num_workers": 16,
        "batch_size": 32,
        "prefetch_factor": 2,
        "persistent_workers": True,
        "pin_memory": True,
    }
    assert set(r.reasons) >= set(r.settings)


def test_production_without_cuda_does_not_pin():
    assert (
        profile_settings("production", BIG, cuda_available=False, local_world_size=1).settings[
            "pin_memory"
        ]
        is False
    )


def test_memory_profile_two_to_four_workers():
    s = profile_settings("memory", BIG, cuda_available=True, local_world_size=1).settings
    assert s["num_workers"] == 4 and s["prefetch_factor"] == 1 and s["batch_size"] == 16
    small = profile_settings(
        "memory", _res(cpus=4, memory_gib=64, gpus=1), cuda_available=True, local_world_size=1
    )
    assert small.settings["num_workers"] == 3  # smart gives 4 - 1 reserved; within the 2-4 range


def test_throughput_profile_eight_to_sixteen_within_resources():
    s = profile_settings("throughput", BIG, cuda_available=True, local_world_size=1).settings
    assert s["num_workers"] == 16 and s["prefetch_factor"] == 1 and s["batch_size"] == 64
    mid = profile_settings(
        "throughput", _res(cpus=12, gpus=1), cuda_available=True, local_world_size=1
    )
    assert mid.settings["num_workers"] == 10  # smart's 12 - 2 reserved is above the floor of 8
    low = profile_settings(
        "throughput", _res(cpus=9, gpus=1), cuda_available=True, local_world_size=1
    )
    assert low.settings["num_workers"] == 8  # smart gives 7: raised to the profile's floor
    tiny = profile_settings(
        "throughput", _res(cpus=4, gpus=1), cuda_available=True, local_world_size=1
    )
    assert tiny.settings["num_workers"] == 3  # bounded: one CPU stays with the main process


def test_text_is_production_without_pinning():
    prod = profile_settings("production", BIG, cuda_available=True, local_world_size=1).settings
    text = profile_settings("text", BIG, cuda_available=True, local_world_size=1).settings
    assert text == {**prod, "pin_memory": False}


def test_auto_picks_memory_when_the_estimate_exceeds_the_budget():
    res = _res(cpus=32, memory_gib=16, gpus=8)
    small = profile_settings(
        "auto", res, sample_bytes=1000, cuda_available=False, local_world_size=1
    )
    assert small.profile == "production"
    huge = profile_settings(
        "auto", res, sample_bytes=64 * 2**20, cuda_available=False, local_world_size=1
    )
    assert huge.profile == "memory"
    assert "exceeds the budget" in huge.reasons["profile"]


def test_workers_are_lowered_to_fit_memory():
    res = _res(cpus=32, memory_gib=16, gpus=8)
    r = profile_settings(
        "production", res, sample_bytes=32 * 2**20, cuda_available=False, local_world_size=1
    )
    # budget 8 GiB; one worker holds 32 * 32 MiB * 2 * 1.4 = 2.8 GiB -> 2 workers
    assert r.settings["num_workers"] == 2


def test_ranks_divide_the_node():
    one = profile_settings("production", BIG, cuda_available=True, local_world_size=1).settings
    eight = profile_settings("production", BIG, cuda_available=True, local_world_size=8).settings
    assert one["num_workers"] == 16 and eight["num_workers"] == 3  # 4 CPUs per rank - 1 reserved


def test_unknown_profile_error_shape():
    with pytest.raises(
        ValueError, match=r"`profile` must be one of debug, .*, but is 'fast' instead\."
    ):
        profile_settings("fast", BIG)


def test_every_profile_has_reasons_for_every_setting():
    for name in PROFILES:
        r = profile_settings(name, BIG, sample_bytes=1000, cuda_available=True, local_world_size=1)
        assert set(r.settings) <= set(r.reasons), name
