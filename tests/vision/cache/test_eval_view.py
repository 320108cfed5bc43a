"""The eval view (issue 21): an eval dataset's cache stores each image as torchvision's eval
transform makes it, so warm eval is a row copy with torchvision's pixels; the thread path
(`read_batch`) serves the same items as the DataLoader path, and its train crops follow
torchvision's distribution."""

import json

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader

from recipes.common import ThreadLoader, make_loader
from recipes.testing import make_image_folder
from recipes.vision import ImageFolderFast, build_image_cache, uint8_collate
from tests.vision.cache.test_image_cache import assert_crops_follow_torchvision, spy_boxes


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """ImageNet-like JPEGs (about 500x375, some portrait, quality 90)."""
    return make_image_folder(tmp_path_factory.mktemp("photos"), classes=3, per_class=6, seed=11)


def _mad(a, b):
    return (a.int() - b.int()).abs().float().mean().item()


def _torchvision(root, size=224, side=256):
    return torchvision.datasets.ImageFolder(
        root, transform=T.Compose([T.Resize(side), T.CenterCrop(size), T.PILToTensor()])
    )


def test_warm_eval_pixels_are_torchvisions_within_a_grey_level(photos, tmp_path):
    ds = ImageFolderFast(photos, size=224)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    assert ds.eval_view is not None and ds.eval_view.size == (224, 224)
    reference = _torchvision(photos)
    mads = [_mad(ds[i][0], reference[i][0]) for i in range(len(ds))]
    assert np.mean(mads) <= 1.0 and max(mads) <= 1.5, mads
    whole = ImageFolderFast(
        photos, size=224
    )  # the same cache without its view: resized out of the store
    whole.use_cache(ds.cache)
    whole._cached.views[(224, 224)] = None
    assert np.mean([_mad(whole[i][0], reference[i][0]) for i in range(len(ds))]) > np.mean(mads)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """One JPEG per class: portrait, landscape, small and tiny (upscaled at every size)."""
    import cv2

    from recipes.testing import natural_image

    root, rng = tmp_path_factory.mktemp("shapes"), np.random.default_rng(5)
    for c, (h, w) in enumerate([(200, 120), (120, 200), (30, 40), (17, 9)]):
        (root / f"c{c}").mkdir()
        cv2.imwrite(
            str(root / f"c{c}" / "a.jpg"), natural_image(h, w, rng), [cv2.IMWRITE_JPEG_QUALITY, 90]
        )
    return root


@pytest.mark.parametrize("size", [64, 128, 224])
def test_every_view_pixel_is_torchvisions_within_one_grey_level(shapes, tmp_path, size):
    """Review B8: the view holds torchvision's `Resize + CenterCrop` of a full decode (what the
    docs promise), not the uncached file path's pixels, which crops before it resizes (a box in
    whole source pixels): those differ from torchvision's by a mean of ~2 grey levels, and by
    up to ~100 at sharp edges and on upscaled small images."""
    ds = ImageFolderFast(shapes, size=size)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    assert ds.eval_view is not None and ds.eval_view.size == (size, size)
    reference = _torchvision(shapes, size, int(size / 0.875))
    for i in range(len(ds)):
        served, want = ds[i][0], reference[i][0]
        assert (served.int() - want.int()).abs().max() <= 1, (size, i)
        assert torch.equal(served, ds.eval_record(i))


def test_the_view_is_built_for_eval_reopened_and_other_resolutions_fall_back(photos, tmp_path):
    train = ImageFolderFast(photos, size=96, train=True)
    build_image_cache(train, tmp_path, num_workers=0, progress=False)
    assert train.eval_view is None and not list(train.cache.path.glob("eval-*"))  # train: no view
    ds = ImageFolderFast(photos, size=96, max_side=192, cache_dir=tmp_path)  # the same cache, eval
    assert ds.cache is not None and ds.eval_view is None
    first = [ds[i][0].clone() for i in range(3)]  # served from the whole images meanwhile
    build_image_cache(
        ds, tmp_path, num_workers=0, progress=False
    )  # adds the view to the existing cache
    assert sorted(p.name for p in ds.cache.path.glob("eval-*")) == [
        "eval-96x96-crop0.875.bin",
        "eval-96x96-crop0.875.json",
        "eval-96x96-crop0.875.sums",
    ]
    again = ImageFolderFast(photos, size=96, max_side=192, cache_dir=tmp_path)
    assert again.eval_view is not None
    rows = [again[i][0] for i in range(len(again))]
    assert all(
        torch.equal(rows[i], again.eval_record(i)) for i in range(len(again))
    )  # a row copy of the view
    assert all(_mad(rows[i], first[i]) < 3 for i in range(3))
    again.set_resolution(
        64
    )  # no view at 64: correct first (torchvision's geometry over the whole image)
    assert again.eval_view is None and again[0][0].shape == (3, 64, 64)
    with pytest.raises(ValueError, match="train=True"):
        train.eval_record(0)


@pytest.mark.parametrize("damage", ["other_fingerprint", "short_data", "bad_json"])
def test_a_damaged_view_is_not_served_and_the_next_build_replaces_it(photos, tmp_path, damage):
    ds = ImageFolderFast(photos, size=64)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    header = ds.cache.path / "eval-64x64-crop0.875.json"
    data = ds.cache.path / "eval-64x64-crop0.875.bin"
    if damage == "other_fingerprint":
        header.write_text(json.dumps({**json.loads(header.read_text()), "fingerprint": "0" * 64}))
    elif damage == "short_data":
        data.write_bytes(data.read_bytes()[:-10])
    else:
        header.write_text("{not json")
    reopened = ImageFolderFast(photos, size=64, cache_dir=tmp_path)
    assert reopened.cache is not None and reopened.eval_view is None  # never served
    build_image_cache(reopened, tmp_path, num_workers=0, progress=False)
    assert reopened.eval_view is not None
    assert torch.equal(reopened[5][0], reopened.eval_record(5))


def test_threads_serve_what_workers_serve(photos, tmp_path):
    ds = ImageFolderFast(photos, size=64)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    threaded = make_loader(ds, batch_size=5)
    assert isinstance(threaded, ThreadLoader)
    workers = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=uint8_collate)
    for (a, ta), (b, tb) in zip(threaded, workers, strict=True):
        assert torch.equal(a, b) and torch.equal(ta, tb)
        assert a.is_contiguous(memory_format=torch.channels_last) and a.dtype == torch.uint8
    assert (
        make_loader(ds, batch_size=5, collate_fn=uint8_collate).recipe.settings["path"] == "threads"
    )
    with_transform = ImageFolderFast(
        photos, size=64, cache_dir=tmp_path, transform=lambda x: x.flip(-2)
    )
    assert with_transform.thread_batches() is False
    assert (
        "thread_batches() is false"
        in make_loader(with_transform, batch_size=5).recipe.reasons["path"]
    )
    with pytest.raises(ValueError, match=r"a `transform` \(Python per item\)"):
        with_transform.read_batch([0], np.random.default_rng(0))


def test_thread_path_train_crops_follow_torchvision(tmp_path, monkeypatch):
    """The thread path draws its crops as the worker path does: torchvision's scale, ratio and
    position distribution over the whole stored image (the worker path's KS test, y centre
    included)."""
    import cv2

    import recipes.vision.cache.cached_batches as module
    from recipes.testing import natural_image

    rng = np.random.default_rng(3)
    (tmp_path / "wide" / "a").mkdir(parents=True)
    for k in range(4):
        cv2.imwrite(str(tmp_path / "wide" / "a" / f"{k}.jpg"), natural_image(320, 640, rng))
    ds = ImageFolderFast(tmp_path / "wide", size=48, train=True)
    build_image_cache(ds, tmp_path / "c", num_workers=0, progress=False)
    seen = spy_boxes(monkeypatch, module)
    loader = ThreadLoader(ds, batch_size=40, shuffle=True, seed=5, threads=2)
    for _ in range(38):  # 3,040 crops, 4 per batch position
        for _ in loader:
            pass
    assert_crops_follow_torchvision(np.array(seen, dtype=float), 320, 640)  # as for the worker path


def test_thread_train_batches_are_the_crops_and_flips_their_rng_draws(photos, tmp_path):
    """read_batch's rows against the crops read one by one with the same draws (box, then flip)."""
    from recipes.vision.decoding.crop import random_resized_box

    ds = ImageFolderFast(photos, size=64, train=True)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    indices = list(range(len(ds)))
    images, targets = ds.read_batch(indices, np.random.default_rng(7))
    rng, flips = np.random.default_rng(7), 0
    for row, i in enumerate(indices):
        h, w = (int(v) for v in ds.cache.shapes[i])
        expected = ds.cache.read_crop(
            i, random_resized_box(h, w, rng, ds.SCALE, ds.RATIO), (64, 64)
        )
        if rng.random() < 0.5:
            expected, flips = expected.flip(-1), flips + 1
        assert torch.equal(images[row], expected), row
    assert 0 < flips < len(indices) and targets.tolist() == ds.targets.tolist()


def test_a_killed_view_builds_temp_files_are_swept(photos, tmp_path):
    """An eval-view build killed midway leaves `.eval-*.tmp` files inside the cache folder:
    the next dataset that opens the cache removes a dead builder's, never a live one's."""
    from recipes.common.caches.cache_files import _host
    from tests.vision.cache.test_image_cache import _dead_pid

    cache = build_image_cache(
        ImageFolderFast(photos, size=64), tmp_path, num_workers=0, progress=False
    )
    dead, live = _dead_pid(), __import__("os").getpid()
    names = [
        f".eval-64x64-crop0.875.{_host()}.{dead}.data.tmp",
        f".eval-64x64-crop0.875.{_host()}.{dead}.json.tmp",
        f".eval-96x96-crop0.875.{_host()}.{live}.data.tmp",
        f".eval-64x64-crop0.875.elsewhere.{dead}.data.tmp",
    ]
    for name in names:
        (cache.path / name).write_bytes(b"partial")
    ds = ImageFolderFast(photos, size=64, cache_dir=tmp_path)
    assert ds.eval_view is not None
    assert sorted(p.name for p in cache.path.glob(".eval-*")) == sorted(names[2:])
