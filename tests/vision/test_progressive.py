import pytest
from torch.utils.data import DataLoader

from recipes.common import worker_init
from recipes.vision import ImageFolderFast, ProgressiveResolution, uint8_collate
from recipes.vision.decoding import (
    region_decode as decode_box_module,  # ImageFolderFast._decode_box's decoders
)


def test_schedule():
    s = ProgressiveResolution(start=128, end=224, start_epoch=2, end_epoch=10, step=32)
    got = [s.resolution(e) for e in range(13)]
    assert got[:3] == [128, 128, 128] and got[10:] == [224, 224, 224]
    assert got == sorted(got) and all(r % 32 == 0 for r in got)
    assert set(got) <= {128, 160, 192, 224}


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"start": 0}, "start"),
        ({"step": -32}, "step"),
        ({"start_epoch": 5, "end_epoch": 2}, "end_epoch"),
    ],
)
def test_schedule_validation(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}` must"):
        ProgressiveResolution(**kwargs)


def test_resolution_change_reaches_persistent_workers(image_tree):
    ds = ImageFolderFast(image_tree, size=128, train=True)
    schedule = ProgressiveResolution(start=64, end=128, start_epoch=0, end_epoch=2, step=32)
    loader = DataLoader(
        ds,
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        collate_fn=uint8_collate,
        worker_init_fn=worker_init,
    )
    sizes = []
    for epoch in range(3):
        schedule.apply(ds, epoch)  # in the main process, after the workers exist
        sizes.append({tuple(images.shape[2:]) for images, _ in loader})
    assert sizes == [{(64, 64)}, {(96, 96)}, {(128, 128)}]


def test_low_resolution_decodes_at_a_coarser_dct_scale(image_tree, monkeypatch):
    seen = []
    real = decode_box_module.decode_image
    monkeypatch.setattr(
        decode_box_module,
        "decode_image",
        lambda data, *, reduce=1, **kw: seen.append(reduce) or real(data, reduce=reduce, **kw),
    )
    ds = ImageFolderFast(
        image_tree, size=224, region_decode=False
    )  # the DCT scale alone (see test_region_decode)
    ds[0]
    ds.set_resolution(128)
    ds[0]
    ds.set_resolution(64)
    ds[0]
    assert seen == [1, 2, 4]
