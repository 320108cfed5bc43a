import pytest

from recipes.common import estimate_loader_memory, max_workers_for_memory


def test_estimate_is_workers_batch_sample_prefetch_plus_margin():
    got = estimate_loader_memory(
        num_workers=4, batch_size=32, sample_bytes=1000, prefetch_factor=2, margin=0.4
    )
    assert got == int(4 * 32 * 1000 * 2 * 1.4)


def test_estimate_with_zero_workers_is_one_batch():
    got = estimate_loader_memory(
        num_workers=0, batch_size=8, sample_bytes=100, prefetch_factor=None, margin=0.0
    )
    assert got == 800


def test_max_workers_for_memory_is_the_inverse():
    kw = dict(batch_size=32, sample_bytes=600_000, prefetch_factor=2)
    budget = estimate_loader_memory(num_workers=5, **kw)
    assert max_workers_for_memory(budget, **kw) == 5
    assert max_workers_for_memory(budget - 1, **kw) == 4


@pytest.mark.parametrize("field", ["num_workers", "sample_bytes", "margin"])
def test_estimate_rejects_negative(field):
    kw = dict(num_workers=1, batch_size=1, sample_bytes=1, prefetch_factor=1, margin=0.1)
    kw[field] = -1
    with pytest.raises(ValueError, match=f"`{field}` must be non-negative, but is -1 instead."):
        estimate_loader_memory(**kw)
