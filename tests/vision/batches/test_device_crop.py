import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from recipes.testing import make_image_folder
from recipes.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DeviceCropLoader,
    DeviceNormalize,
    ImageFolderFast,
    build_image_cache,
)
from recipes.vision.decoding.decode import resize_uint8


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    root = make_image_folder(tmp_path_factory.mktemp("tree"), classes=3, per_class=7, seed=11)
    cache_dir = tmp_path_factory.mktemp("cache")
    build_image_cache(ImageFolderFast(root, size=64), cache_dir, num_workers=0, progress=False)
    return root, cache_dir


def _dataset(cached, **kw):
    root, cache_dir = cached
    ds = ImageFolderFast(root, size=64, cache_dir=cache_dir, **kw)
    assert ds.cache is not None
    return ds


def _normalized(images_uint8):
    return DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD, device="cpu")(images_uint8)


def _grey(a, b):
    """|a - b| of normalised batches, in grey levels, per image."""
    return ((a - b) * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255).abs().flatten(1).mean(1)


def test_eval_batches_equal_the_cached_cpu_path(cached):
    ds = _dataset(cached)
    loader = DeviceCropLoader(ds, batch_size=4, shuffle=False, device="cpu", threads=2)
    got = list(loader)
    assert len(got) == len(loader) == 6  # 21 images: five of 4 and one of 1
    images = torch.cat([b[0] for b in got])
    targets = torch.cat([b[1] for b in got])
    expected = _normalized(torch.stack([ds[i][0] for i in range(len(ds))]))
    assert images.shape == (21, 3, 64, 64) and images.is_contiguous(
        memory_format=torch.channels_last
    )
    assert _grey(images, expected).mean() < 1.0  # the same eval crops, resized on the device
    assert targets.tolist() == ds.targets.tolist()


def test_train_crops_match_a_cpu_resize_of_the_same_boxes(cached):
    ds = _dataset(cached, train=True)
    loader = DeviceCropLoader(ds, batch_size=5, shuffle=False, seed=3, device="cpu")
    for k, (images, _) in enumerate(loader):
        indices = range(5 * k, min(5 * k + 5, len(ds)))
        boxes, flips = loader.boxes(
            ds.cache.shapes[list(indices)], np.random.default_rng([3, 0, k])
        )
        for row, (i, (top, left, h, w), flip) in enumerate(zip(indices, boxes, flips, strict=True)):
            reference = resize_uint8(ds.cache.read(i)[top : top + h, left : left + w], (64, 64))
            if flip:
                reference = reference.flip(-1)
            grey = (
                (images[row] - _normalized(reference[None])[0])
                * torch.tensor(IMAGENET_STD).view(3, 1, 1)
                * 255
            )
            assert grey.abs().mean() < 1.0, (i, grey.abs().mean())


def test_order_crops_and_threads_are_deterministic(cached):
    ds = _dataset(cached, train=True)

    def epoch(threads, epoch_number=0, seed=0):
        loader = DeviceCropLoader(ds, batch_size=4, seed=seed, device="cpu", threads=threads)
        loader.set_epoch(epoch_number)
        return torch.cat([b[0] for b in loader]), torch.cat([b[1] for b in loader])

    one, three = epoch(1), epoch(3)
    torch.testing.assert_close(one[0], three[0], atol=0, rtol=0)
    assert one[1].tolist() == three[1].tolist()
    assert sorted(one[1].tolist()) == sorted(ds.targets.tolist())  # a permutation of the dataset
    other = epoch(2, epoch_number=1)
    assert not torch.equal(one[0], other[0])


def test_a_distributed_sampler_splits_the_dataset(cached):
    ds = _dataset(cached)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(
            ds, num_replicas=2, rank=rank, shuffle=True, seed=5, drop_last=False
        )
        loader = DeviceCropLoader(ds, batch_size=3, sampler=sampler, device="cpu")
        loader.set_epoch(2)
        order = list(sampler)
        images = torch.cat([b[0] for b in loader])
        assert _grey(images, _normalized(torch.stack([ds[i][0] for i in order]))).max() < 1.5
        seen += order
    assert sorted(set(seen)) == list(range(len(ds))) and len(seen) == 22  # 21 + one padded repeat


def test_progressive_resolution_and_drop_last(cached):
    ds = _dataset(cached, train=True)
    ds.set_resolution(48)
    loader = DeviceCropLoader(ds, batch_size=4, drop_last=True, device="cpu")
    shapes = {tuple(b[0].shape) for b in loader}
    assert shapes == {(4, 3, 48, 48)} and len(loader) == 5


def test_clear_errors(cached):
    root, _ = cached
    with pytest.raises(ValueError, match="build_image_cache"):
        DeviceCropLoader(ImageFolderFast(root, size=64), batch_size=4, device="cpu")
    with pytest.raises(ValueError, match="transform"):
        DeviceCropLoader(_dataset(cached, transform=lambda x: x), batch_size=4, device="cpu")
    with pytest.raises(
        ValueError, match="`batch_size` must be a positive integer, but is 0 instead."
    ):
        DeviceCropLoader(_dataset(cached), batch_size=0, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            DeviceCropLoader(_dataset(cached), batch_size=4)


@pytest.mark.gpu
def test_cuda_batches_equal_the_cpu_ones(cached):
    ds = _dataset(cached, train=True)
    cpu = [b[0] for b in DeviceCropLoader(ds, batch_size=4, device="cpu")]
    gpu = [b[0].cpu() for b in DeviceCropLoader(ds, batch_size=4, device="cuda")]
    for a, b in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(a, b, atol=2 / 255 / 0.224, rtol=0)
