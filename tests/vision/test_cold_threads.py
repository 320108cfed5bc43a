"""The cold thread path (issue 21): without a cache, `make_loader` decodes `ImageFolderFast`
batches in threads of the training process (OpenCV and nvImageCodec release the GIL), with
the pixels, crops, strict checks and skip counts of the worker path."""

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.common import ThreadLoader, make_loader
from recipes.testing import make_image_folder
from recipes.vision import ImageDecodeError, ImageFolderFast, uint8_collate
from recipes.vision.decoding.region_decode import region_decode_available
from tests.vision.cache.test_image_cache import assert_crops_follow_torchvision, spy_boxes
from tests.vision.decoding.test_decode import _tree, damaged, kinds, mutated  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("photos"), classes=3, per_class=6, seed=12)


@pytest.mark.parametrize(
    "region",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not region_decode_available(),
                reason='needs nvImageCodec (pip install "loader-recipes[roi]")',
            ),
        ),
    ],
)
def test_make_loader_decodes_in_threads_what_workers_decode(photos, region):
    """Eval at 224 px decodes 500x375 files at full DCT scale, through the region decoder when
    asked: 4 threads share nvImageCodec (one decoder per thread) and libjpeg's stderr check."""
    ds = ImageFolderFast(photos, size=224, region_decode=region)
    loader = make_loader(ds, batch_size=5)
    assert isinstance(loader, ThreadLoader)
    assert "decod" in loader.recipe.reasons["path"]
    loader = ThreadLoader(ds, batch_size=5, threads=4)
    workers = DataLoader(
        ImageFolderFast(photos, size=224, region_decode=region),
        batch_size=5,
        num_workers=2,
        collate_fn=uint8_collate,
    )
    for _ in range(2):  # the first pass checks each file (strict), the second decodes unchecked
        batches = 0
        for (a, ta), (b, tb) in zip(loader, workers, strict=True):
            assert torch.equal(a, b) and torch.equal(ta, tb)
            assert a.is_contiguous(memory_format=torch.channels_last)
            batches += 1
        assert batches == 4


@pytest.mark.parametrize(
    "region",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not region_decode_available(),
                reason='needs nvImageCodec (pip install "loader-recipes[roi]")',
            ),
        ),
    ],
)
def test_train_batches_depend_on_the_seed_not_the_threads(photos, region):
    """At 128 px most crops are region decodes (DCT scale 1 or 2): one nvImageCodec decoder
    shared by threads returned other pixels and "Broken promise" errors."""

    def epoch(threads):
        loader = ThreadLoader(
            ImageFolderFast(photos, size=128, train=True, region_decode=region),
            batch_size=4,
            shuffle=True,
            seed=9,
            threads=threads,
            generator=torch.Generator().manual_seed(1),
        )
        return [batch for _ in range(2) for batch in loader]

    one, three = epoch(1), epoch(4)
    assert len(one) == 10 and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, three, strict=True)
    )
    assert not all(
        torch.equal(a[0], b[0]) for a, b in zip(one, epoch(1)[::-1], strict=True)
    )  # not one crop for all


def test_cold_thread_crops_follow_torchvision(tmp_path, monkeypatch):
    import cv2

    import recipes.vision.image_folder as module
    from recipes.testing import natural_image

    rng = np.random.default_rng(4)
    (tmp_path / "wide" / "a").mkdir(parents=True)
    for k in range(4):
        cv2.imwrite(str(tmp_path / "wide" / "a" / f"{k}.jpg"), natural_image(320, 640, rng))
    ds = ImageFolderFast(tmp_path / "wide", size=32, train=True)
    seen = spy_boxes(monkeypatch, module)
    loader = make_loader(ds, batch_size=40, shuffle=True)
    assert isinstance(loader, ThreadLoader)
    for _ in range(40):  # 3,200 crops
        for _ in loader:
            pass
    assert_crops_follow_torchvision(np.array(seen, dtype=float), 320, 640)


def test_threads_raise_naming_the_file_and_skip_counts(tmp_path, mutated, damaged, kinds):  # noqa: F811
    root = _tree(tmp_path, {**kinds, **mutated})
    names = [
        os.path.basename(p)[: -len(".jpg")].replace("_", " ") for p in ImageFolderFast(root).paths
    ]
    first_bad = next(i for i, n in enumerate(names) if n in damaged)
    ds = ImageFolderFast(root, size=64)
    with pytest.raises(ImageDecodeError, match=rf"index {first_bad}\).*strict=False"):
        for _ in ThreadLoader(ds, batch_size=8, threads=3):
            pass
    skipping = ImageFolderFast(root, size=64, on_error="skip", train=True)
    loader = make_loader(skipping, batch_size=8)
    assert isinstance(loader, ThreadLoader)
    assert sum(len(targets) for _, targets in loader) == len(skipping)
    assert skipping.skipped == len(damaged)
    assert skipping.skipped_indices().tolist() == [i for i, n in enumerate(names) if n in damaged]


@pytest.mark.parametrize("cached", [False, True])
def test_a_collate_function_of_the_users_keeps_the_batch_draws(photos, tmp_path, cached):
    """With a collate function of the user's the items come from read_items: the crops and flips
    read_batch would draw, whatever the threads."""
    from recipes.vision import build_image_cache

    ds = ImageFolderFast(photos, size=48, train=True)
    if cached:
        build_image_cache(ds, tmp_path, num_workers=0, progress=False)

    def epoch(threads, **kwargs):
        loader = ThreadLoader(
            ds,
            batch_size=4,
            shuffle=True,
            seed=9,
            threads=threads,
            generator=torch.Generator().manual_seed(1),
            **kwargs,
        )
        return [batch for batch in loader]

    mine = epoch(1, collate_fn=lambda items: uint8_collate(items))
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(mine, epoch(3), strict=True)
    )
    assert all(
        torch.equal(a[0], b[0])
        for a, b in zip(mine, epoch(3, collate_fn=lambda items: uint8_collate(items)), strict=True)
    )
