import pytest
import torch

from recipes.vision import IMAGENET_MEAN, IMAGENET_STD, DeviceNormalize, uint8_collate


def _items(n=3, h=8, w=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g), i) for i in range(n)]


def test_uint8_collate_stacks_like_torch_stack():
    items = _items()
    # a channels-last view (as the decoder and the cache produce) and a contiguous tensor
    items[1] = (items[1][0].permute(1, 2, 0).contiguous().permute(2, 0, 1), 1)
    images, targets = uint8_collate(items)
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 8, 6)
    assert torch.equal(images, torch.stack([x for x, _ in items]))
    assert targets.dtype == torch.int64 and targets.tolist() == [0, 1, 2]
    assert images.is_contiguous()  # the first item's layout (contiguous) is kept


def test_uint8_collate_keeps_channels_last_items_channels_last():
    items = [(x.permute(1, 2, 0).contiguous().permute(2, 0, 1), t) for x, t in _items()]
    images, _ = uint8_collate(items)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images, torch.stack([x for x, _ in items]))


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            [
                (torch.zeros(3, 4, 4, dtype=torch.uint8), 0),
                (torch.zeros(3, 5, 4, dtype=torch.uint8), 1),
            ],
            "item 1 has shape",
        ),
        ([(torch.zeros(3, 4, 4), 0)], "expected a uint8 tensor"),
    ],
)
def test_uint8_collate_errors_name_the_item(bad, message):
    with pytest.raises(TypeError, match=message):
        uint8_collate(bad)


def test_device_normalize_on_cpu_matches_the_formula():
    images, targets = uint8_collate(_items())
    normalize = DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD, device="cpu")
    out, out_targets = normalize(images, targets)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = (images.float() / 255 - mean) / std
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-5)
    assert out.is_contiguous() and torch.equal(out_targets, targets)


def test_device_normalize_dtype_and_channels_last():
    images, _ = uint8_collate(_items())
    out = DeviceNormalize(
        (0.5,) * 3, (0.25,) * 3, device="cpu", dtype=torch.bfloat16, channels_last=True
    )(images)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out.float(), (images.float() / 255 - 0.5) / 0.25, atol=0.05)


def test_device_normalize_validates():
    with pytest.raises(ValueError, match="`std` must be positive"):
        DeviceNormalize((0.5,), (0.0,), device="cpu")
    with pytest.raises(TypeError, match="uint8"):
        DeviceNormalize((0.5,) * 3, (0.5,) * 3, device="cpu")(torch.zeros(1, 3, 2, 2))


def test_uint8_batches_are_a_quarter_of_float32():
    images, _ = uint8_collate(_items(n=4, h=224, w=224))
    assert images.numel() * images.element_size() * 4 == images.float().numel() * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_uint8_batches_normalise_on_the_gpu(image_tree):
    from torch.utils.data import DataLoader

    from recipes.common import worker_init
    from recipes.vision import ImageFolderFast

    ds = ImageFolderFast(image_tree, size=64)
    loader = DataLoader(
        ds,
        batch_size=4,
        num_workers=2,
        pin_memory=True,
        collate_fn=uint8_collate,
        worker_init_fn=worker_init,
    )
    normalize = DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD, device="cuda", channels_last=True)
    for images, targets in loader:
        assert images.is_pinned()
        out, targets = normalize(images, targets)
        assert out.is_cuda and out.shape == (len(targets), 3, 64, 64)
        cpu = DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD, device="cpu")(images)
        assert torch.allclose(out.cpu(), cpu, atol=1e-4)
