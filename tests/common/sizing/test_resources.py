import os

import psutil
import pytest

from recipes.common import Resources, detect_resources, smart_num_workers
from recipes.common.sizing.resources import GiB


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _affinity():
    return len(os.sched_getaffinity(0))


def test_v2_quota_and_memory_limit(tmp_path):
    _write(tmp_path, "cpu.max", "150000 100000")  # 1.5 CPUs
    _write(tmp_path, "memory.max", str(2 * GiB))
    _write(tmp_path, "memory.current", str(GiB // 2))
    res = detect_resources(cgroup_root=tmp_path)
    assert res.cpu_quota == pytest.approx(1.5)
    assert res.cpus == min(_affinity(), 2)  # 1.5 rounds up
    assert res.memory_limit == 2 * GiB
    assert res.memory_usage == GiB // 2
    assert res.memory_available == min(psutil.virtual_memory().available, 2 * GiB - GiB // 2)


def test_v2_unlimited(tmp_path):
    _write(tmp_path, "cpu.max", "max 100000")
    _write(tmp_path, "memory.max", "max")
    _write(tmp_path, "memory.current", "1000")
    res = detect_resources(cgroup_root=tmp_path)
    assert res.cpu_quota is None
    assert res.cpus == _affinity()
    assert res.memory_limit is None
    assert res.memory_available == pytest.approx(psutil.virtual_memory().available, rel=0.05)


def test_v2_fractional_quota_rounds_up_to_one(tmp_path):
    _write(tmp_path, "cpu.max", "50000 100000")
    assert detect_resources(cgroup_root=tmp_path).cpus == 1


@pytest.mark.parametrize("folder", ["cpu", "cpu,cpuacct"])
def test_v1_quota_and_memory_limit(tmp_path, folder):
    _write(tmp_path, f"{folder}/cpu.cfs_quota_us", "100000")
    _write(tmp_path, f"{folder}/cpu.cfs_period_us", "100000")
    _write(tmp_path, "memory/memory.limit_in_bytes", str(3 * GiB))
    _write(tmp_path, "memory/memory.usage_in_bytes", str(GiB))
    res = detect_resources(cgroup_root=tmp_path)
    assert res.cpu_quota == 1.0
    assert res.cpus == 1
    assert res.memory_limit == 3 * GiB
    assert res.memory_available <= 2 * GiB


def test_v1_unlimited(tmp_path):
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")
    _write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    _write(tmp_path, "memory/memory.limit_in_bytes", "9223372036854771712")
    _write(tmp_path, "memory/memory.usage_in_bytes", str(GiB))
    res = detect_resources(cgroup_root=tmp_path)
    assert res.cpu_quota is None and res.cpus == _affinity()
    assert res.memory_limit is None


def test_limit_above_host_ram_is_no_limit(tmp_path):
    _write(tmp_path, "memory.max", str(psutil.virtual_memory().total * 4))
    assert detect_resources(cgroup_root=tmp_path).memory_limit is None


def test_missing_files_fall_back_to_host(tmp_path):
    res = detect_resources(cgroup_root=tmp_path / "absent", shm_path=tmp_path / "no-shm")
    assert res.cpus == _affinity()
    assert res.cpus_logical == os.cpu_count()
    assert res.memory_limit is None and res.cpu_quota is None
    assert res.shm_bytes == 0 and res.shm_free == 0
    assert res.nofile_limit > 0


def test_shm_is_measured(tmp_path):
    st = os.statvfs(tmp_path)
    res = detect_resources(cgroup_root=tmp_path, shm_path=tmp_path)
    assert res.shm_bytes == st.f_blocks * st.f_frsize


def test_resources_is_frozen():
    res = detect_resources()
    with pytest.raises(AttributeError):
        res.cpus = 99


def _res(cpus=32, memory_gib=256, gpus=0, **kw):
    return Resources(
        cpus=cpus,
        cpus_logical=cpus,
        memory_available=memory_gib * GiB,
        memory_limit=None,
        shm_bytes=64 * GiB,
        shm_free=64 * GiB,
        gpus=gpus,
        nofile_limit=65536,
        **kw,
    )


@pytest.mark.parametrize(
    "cpus, memory_gib, gpus, ranks, expected",
    [
        (32, 256, 8, 1, 16),  # 32 - 5 reserved = 27 -> max_workers 16
        (32, 256, 8, 8, 3),  # torchrun: 4 CPUs per rank, 1 reserved -> 3
        (16, 128, 1, 1, 13),  # the 16-core, 1-GPU node of issue #9: 16 - 3 reserved
        (32, 256, 0, 1, 16),  # no GPU term: CPU machines are sized by CPUs and memory
        (8, 4, 1, 1, 2),  # memory: 4 GiB // 2 GiB = 2
        (8, 1, 1, 1, 1),  # memory term is 0, but a CPU is free -> at least 1
        (1, 64, 1, 1, 0),  # one CPU: the main process needs it
        (64, 512, 8, 1, 16),  # never above max_workers
        (2, 24, 0, 1, 1),  # this CI machine's shape
    ],
)
def test_smart_num_workers_table(cpus, memory_gib, gpus, ranks, expected):
    res = _res(cpus=cpus, memory_gib=memory_gib, gpus=gpus)
    assert smart_num_workers(res, local_world_size=ranks) == expected


def test_smart_num_workers_reads_local_world_size(monkeypatch):
    res = _res(cpus=32, gpus=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert smart_num_workers(res) == smart_num_workers(res, local_world_size=4) == 6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "nope")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        smart_num_workers(res)


def test_smart_num_workers_follows_real_affinity(tmp_path, zygote):
    """A child pinned to one CPU sees one effective CPU and gets no worker."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]});"
        "from recipes.common import detect_resources, smart_num_workers;"
        f"r = detect_resources(cgroup_root={str(tmp_path)!r});"
        "print(r.cpus, smart_num_workers(r, local_world_size=1))"
    )
    out = zygote.python(code)
    assert out.wait(timeout=60) == 0, out.stderr
    assert out.stdout.split() == ["1", "0"]


def test_smart_num_workers_optional_gpu_cap():
    res = _res(cpus=16, gpus=1)
    assert smart_num_workers(res, local_world_size=1, workers_per_gpu=4) == 4
    assert smart_num_workers(_res(cpus=32, gpus=8), local_world_size=1, workers_per_gpu=1) == 8


def test_smart_num_workers_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`max_workers` must be positive, but is 0 instead."):
        smart_num_workers(_res(), max_workers=0)
    with pytest.raises(ValueError, match="local_world_size"):
        smart_num_workers(_res(), local_world_size=0)
