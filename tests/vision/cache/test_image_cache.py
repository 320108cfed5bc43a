import os
import pickle
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

from recipes.cli import main
from recipes.common.caches.cache_files import _host
from recipes.testing import make_image_folder
from recipes.vision import (
    ImageCache,
    ImageCacheError,
    ImageFolderFast,
    build_image_cache,
    uint8_collate,
)
from recipes.vision.cache.image_cache import FORMAT_VERSION


def _files(folder):
    """Every file of a cache folder: name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _dead_pid():
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def _mad(a, b):
    return (a.int() - b.int()).abs().float().mean().item()


def test_build_then_serve_equals_decoding(own_tree, tmp_path):
    ds = ImageFolderFast(own_tree, size=96)
    decoded = [ds[i] for i in range(len(ds))]
    cache = build_image_cache(ds, tmp_path / "c", num_workers=2, progress=False)
    assert ds.cache is cache and cache.count == len(ds) and cache.max_side == 192  # 2 x 96
    for i, (path, _) in enumerate(ds.samples):  # each whole image, aspect kept, longer side <= 192
        with Image.open(path) as im:
            width, height = im.size
            scale = min(1.0, 192 / max(width, height))
            stored = cache.read(i)
            assert (
                stored.shape == (round(height * scale), round(width * scale), 3)
                and stored.dtype == np.uint8
            )
            whole = torch.from_numpy(
                np.asarray(im.convert("RGB").resize(stored.shape[1::-1], Image.BILINEAR))
            )
        assert _mad(torch.from_numpy(stored), whole) < 5.0  # DCT-scaled decode + resize vs Pillow's
    assert cache.labels.tolist() == ds.targets.tolist()
    for i, (_, target) in enumerate(decoded):
        cached, cached_target = ds[i]
        assert cached.shape == (3, 96, 96) and cached_target == target
    # Against torchvision (an independent decode and resize): the same bar as decoding from files.
    # (Cached and file-decoded crops differ by up to ~3.5 grey levels from each other: two
    # resampling chains, the store's resize then the crop's, against a DCT-scaled decode.)
    ref = torchvision.datasets.ImageFolder(
        own_tree, transform=T.Compose([T.Resize(109), T.CenterCrop(96), T.PILToTensor()])
    )
    mads = [_mad(ds[i][0], ref[i][0]) for i in range(len(ds))]
    assert max(mads) < 5.0 and np.mean(mads) < 4.0, mads


def test_a_new_dataset_serves_a_matching_cache(own_tree, tmp_path):
    build_image_cache(ImageFolderFast(own_tree, size=64), tmp_path, progress=False, num_workers=0)
    ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is not None and "from cache" in repr(ds)
    # building again reuses the file
    before = (ds.cache.path / "images.bin").stat().st_mtime_ns
    build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    assert (ds.cache.path / "images.bin").stat().st_mtime_ns == before


def test_getitems_equals_getitem(own_tree, tmp_path):
    ds = ImageFolderFast(own_tree, size=64)
    build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    batch = ds.__getitems__([3, 0, 5, 3])
    for (image, target), i in zip(batch, [3, 0, 5, 3], strict=True):
        assert torch.equal(image, ds[i][0]) and target == ds[i][1]


def test_a_bad_index_in_a_transformed_cached_batch_is_refused_before_any_item_is_read(
    own_tree, tmp_path
):
    """With a cache and a `transform`, every index of the batch is checked before the first
    read (as without a transform, and as 137c7d1 did): a refused batch draws no crop or flip, so
    the batches after it are those of a dataset that never saw it."""
    build_image_cache(ImageFolderFast(own_tree, size=32), tmp_path, progress=False, num_workers=0)

    def dataset():
        return ImageFolderFast(
            own_tree, size=32, train=True, cache_dir=tmp_path, transform=lambda x: x.float()
        )

    torch.manual_seed(0)
    refused = dataset()
    for bad in ([0, 1, len(refused)], [2, -len(refused) - 1]):
        with pytest.raises(IndexError):
            refused.__getitems__(bad)
    after_refusal = refused.__getitems__([2, 3, 4])
    torch.manual_seed(0)
    expected = dataset().__getitems__([2, 3, 4])
    for (image, target), (want, want_target) in zip(after_refusal, expected, strict=True):
        assert torch.equal(image, want) and target == want_target


def test_stale_cache_is_not_served(own_tree, tmp_path):
    build_image_cache(ImageFolderFast(own_tree, size=64), tmp_path, progress=False, num_workers=0)
    victim = next(own_tree.rglob("*.jpg"))
    os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10**9))  # the image changed
    ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is None  # a different fingerprint: decoded from files
    other_size = ImageFolderFast(own_tree, size=96, cache_dir=tmp_path)
    assert other_size.cache is None


@pytest.mark.parametrize(
    "damage", ["truncate", "labels", "header", "version", "not_an_object", "skipped"]
)
def test_corrupt_cache_is_detected_and_rebuilt(own_tree, tmp_path, damage):
    cache = build_image_cache(
        ImageFolderFast(own_tree, size=64), tmp_path, progress=False, num_workers=0
    )
    header = cache.path / "header.json"
    if damage == "truncate":
        images = cache.path / "images.bin"
        images.write_bytes(images.read_bytes()[:-1000])
    elif damage == "labels":
        (cache.path / "labels.bin").write_bytes(b"\0" * 7)
    elif damage == "header":
        header.write_bytes(b"\xff" * 10 + header.read_bytes()[10:])
    elif damage == "not_an_object":
        header.write_text("[1, 2]")
    elif damage == "skipped":
        header.write_text(header.read_text().replace('"skipped": []', '"skipped": [99]'))
    else:
        header.write_text(
            header.read_text().replace(f'"version": {FORMAT_VERSION}', '"version": 9')
        )
    with pytest.warns(UserWarning, match="Not using the image cache"):
        ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is None
    rebuilt = build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    expected = 0
    for path, _ in ds.samples:
        with Image.open(path) as im:
            scale = min(1.0, 128 / max(im.size))
            expected += round(im.size[0] * scale) * round(im.size[1] * scale) * 3
    assert ds.cache is rebuilt and (rebuilt.path / "images.bin").stat().st_size == expected


def _flip_label_bits(cache_path, index, mask=1):
    """XORs label `index` of `labels.bin` with `mask` in place (size and header unchanged)."""
    with open(cache_path / "labels.bin", "r+b") as f:
        f.seek(8 * index)
        value = int.from_bytes(f.read(8), "little", signed=True)
        f.seek(8 * index)
        f.write((value ^ mask).to_bytes(8, "little", signed=True))


def test_a_flipped_label_is_refused_with_a_warning_never_served(own_tree, tmp_path):
    cache = build_image_cache(
        ImageFolderFast(own_tree, size=64), tmp_path, progress=False, num_workers=0
    )
    _flip_label_bits(cache.path, 4)  # class 1 -> 0: another valid class, the dangerous case
    reference = torchvision.datasets.ImageFolder(own_tree).targets
    assert reference[4] == 1
    with pytest.warns(
        UserWarning,
        match=rf"Not using the image cache: {re.escape(str(cache.path))}/labels.bin is "
        r"damaged \(its checksum differs.*rebuild the cache with build_image_cache\(\)",
    ):
        ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is None
    assert [ds[i][1] for i in range(len(ds))] == reference
    assert [t for _, t in ds.__getitems__(list(range(len(ds))))] == reference
    rebuilt = build_image_cache(
        ds, tmp_path, progress=False, num_workers=0
    )  # the damaged cache is not reused
    assert ds.cache is rebuilt and rebuilt.labels.tolist() == reference
    assert [ds[i][1] for i in range(len(ds))] == reference


def test_the_label_check_knows_where_skipped_images_were_replaced(own_tree, tmp_path):
    """A bad last file of a class is stored as the next class's first image, with its label; the
    last file of the tree, as the first image. Neither is a damaged label."""
    (own_tree / "class_00" / "zz_bad.jpg").write_bytes(
        b"not a jpeg"
    )  # index 3, replaced by 4 (class 1)
    (own_tree / "class_01" / "zz_bad.jpg").write_bytes(b"")  # index 7, replaced by 0 (class 0)
    files = ImageFolderFast(own_tree, size=64, on_error="skip")
    cache = build_image_cache(
        ImageFolderFast(own_tree, size=64, on_error="skip"), tmp_path, progress=False, num_workers=0
    )
    assert cache.skipped == (3, 7) and cache.labels[[3, 7]].tolist() == [1, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = ImageFolderFast(own_tree, size=64, on_error="skip", cache_dir=tmp_path)
    assert ds.cache is not None
    assert [ds[i][1] for i in range(len(ds))] == [files[i][1] for i in range(len(files))]
    _flip_label_bits(cache.path, 3)  # the replacement's label is checked too
    with pytest.warns(UserWarning, match="labels.bin is damaged"):
        assert ImageFolderFast(own_tree, size=64, on_error="skip", cache_dir=tmp_path).cache is None


@pytest.mark.parametrize("train, name", [(True, "images.bin"), (False, "eval-64x64-crop0.875.bin")])
def test_images_truncated_after_opening_raise_the_cache_error_in_a_fresh_worker(
    own_tree, tmp_path, train, name
):
    """The whole images (read by train crops) or the eval view (read by eval), truncated after
    the dataset opened them: an ImageCacheError naming the file, never a short read served."""
    build_image_cache(ImageFolderFast(own_tree, size=64), tmp_path, progress=False, num_workers=0)
    ds = ImageFolderFast(
        own_tree, size=64, train=train, cache_dir=tmp_path
    )  # opened and checked, nothing read yet
    assert (ds.eval_view is None) == train  # eval: its view opened
    spawned = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives
    forked = ImageFolderFast(own_tree, size=64, train=train, cache_dir=tmp_path)
    assert (forked.eval_view is None) == train
    images = ds.cache.path / name
    os.truncate(images, images.stat().st_size - 1000)
    expected = (
        rf"{re.escape(str(images))} changed after the cache was opened: truncated in place"
        r".*Reopen the cache"
    )
    for dataset in (ds, spawned):
        with pytest.raises(ImageCacheError, match=expected):
            dataset[0]
    with pytest.raises(ImageCacheError, match=expected):  # a forked DataLoader worker
        list(DataLoader(forked, batch_size=2, num_workers=1, collate_fn=uint8_collate))


def test_writes_are_atomic_and_leave_no_temp_files(own_tree, tmp_path):
    ds = ImageFolderFast(own_tree, size=64)
    name = ImageCache.folder_for(tmp_path, ds.cache_fingerprint()).name
    left = tmp_path / f".{name}.{_host()}.{_dead_pid()}.ab.tmp"  # by a builder killed midway
    left.mkdir()
    (left / "images.bin").write_bytes(b"partial")
    elsewhere = (
        tmp_path / f".{name}.another-node.{_dead_pid()}.cd.tmp"
    )  # a live build on another node?
    elsewhere.mkdir()
    build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == [elsewhere.name]


def test_two_processes_building_the_same_cache(own_tree, tmp_path, zygote):
    code = (
        "import sys; from recipes.vision import ImageFolderFast, build_image_cache;"
        "build_image_cache(ImageFolderFast(sys.argv[1], size=64), sys.argv[2], num_workers=0, "
        "progress=False)"
    )
    procs = [zygote.python(code, own_tree, tmp_path) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0], [p.stderr for p in procs]
    ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is not None
    assert [p.name for p in tmp_path.iterdir() if p != own_tree] == [
        ds.cache.path.name
    ]  # one cache, no temp
    assert sorted(_files(ds.cache.path)) == [
        "checksums.bin",
        "eval-64x64-crop0.875.bin",
        "eval-64x64-crop0.875.json",
        "eval-64x64-crop0.875.sums",
        "files.npy",
        "header.json",
        "images.bin",
        "labels.bin",
        "offsets.bin",
        "shapes.bin",
    ]
    single = build_image_cache(
        ImageFolderFast(own_tree, size=64), tmp_path / "single", num_workers=0, progress=False
    )
    assert _files(ds.cache.path) == _files(single.path)


def test_a_stale_cache_is_named_then_replaced(own_tree, tmp_path):
    build_image_cache(ImageFolderFast(own_tree, size=64), tmp_path, num_workers=0, progress=False)
    [old] = tmp_path.glob("images-*")
    images = sorted(own_tree.rglob("*.jpg"))
    os.utime(images[0], ns=(1, 10**18))  # an edited image
    extra = images[1].parent / "new_one.jpg"
    extra.write_bytes(images[1].read_bytes())  # and an added one
    rel_changed = os.path.relpath(images[0], own_tree)
    with pytest.warns(
        UserWarning,
        match=rf"built from other inputs \(images-.*: 6 files when built, 7 now; "
        rf"1 added: .*new_one.jpg; 1 changed \(size or mtime\): {rel_changed}",
    ):
        ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is None
    # A build of another root in the same folder is left alone; this root's old cache is replaced.
    other = make_image_folder(tmp_path / "other", classes=2, per_class=2, seed=9)
    build_image_cache(ImageFolderFast(other, size=64), tmp_path, num_workers=0, progress=False)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    caches = sorted(tmp_path.glob("images-*"))
    assert len(caches) == 2 and old not in caches and not old.exists()


def test_a_cache_of_the_old_single_file_format_is_named_then_replaced(own_tree, tmp_path):
    """Format 1 was one file `images-<fp>.bin` (magic, JSON header padded to 4 KiB, data)."""
    import json

    legacy = tmp_path / "images-0123456789abcdef01234567.bin"
    header = json.dumps(
        {"version": 1, "fingerprint": "0" * 64, "count": 6, "side": 73, "root": str(own_tree)}
    )
    legacy.write_bytes(b"RCPIMG01" + header.encode().ljust(4088) + b"\0" * 1000)
    with pytest.warns(
        UserWarning, match="images-0123456789abcdef01234567.bin was built from other inputs"
    ):
        ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    build_image_cache(ds, tmp_path, num_workers=0, progress=False)
    assert not legacy.exists() and [p.name for p in tmp_path.iterdir() if p != own_tree] == [
        ds.cache.path.name
    ]


def test_opening_sweeps_the_temp_folder_of_a_killed_build(own_tree, tmp_path):
    cache = build_image_cache(
        ImageFolderFast(own_tree, size=64), tmp_path, num_workers=0, progress=False
    )
    temp = tmp_path / f".{cache.path.name}.{_host()}.{_dead_pid()}.0badcafe.tmp"
    temp.mkdir()
    (temp / "images.bin").write_bytes(b"x" * 1000)
    ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert not temp.exists()


def test_train_crops_come_from_the_cached_image(own_tree, tmp_path):
    ds = ImageFolderFast(own_tree, size=48, train=True)
    build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    torch.manual_seed(0)
    crops = [ds[0][0] for _ in range(5)]
    assert all(c.shape == (3, 48, 48) for c in crops)
    assert len({c.float().sum().item() for c in crops}) > 1


def test_another_resolution_from_the_cache_is_torchvisions_eval(own_tree, tmp_path):
    ds = ImageFolderFast(own_tree, size=128)
    files = ImageFolderFast(own_tree, size=128)
    build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    for dataset in (ds, files):
        dataset.set_resolution(
            64
        )  # progressive resizing: eval at 64 is Resize(73) + CenterCrop(64)
    ref = torchvision.datasets.ImageFolder(
        own_tree, transform=T.Compose([T.Resize(73), T.CenterCrop(64), T.PILToTensor()])
    )
    cached = [_mad(ds[i][0], ref[i][0]) for i in range(len(ds))]
    decoded = [_mad(files[i][0], ref[i][0]) for i in range(len(ds))]
    assert all(ds[i][0].shape == (3, 64, 64) for i in range(len(ds)))
    assert max(cached) < 5.0 and np.mean(cached) <= np.mean(decoded), (cached, decoded)


def spy_boxes(monkeypatch, module) -> list:
    """`(h, w, top, left, height, width)` of every random-resized-crop box `module` draws from
    now on, relative to each stored image."""
    seen = []
    original = module.random_resized_box

    def spy(h, w, rng, scale, ratio):
        box = original(h, w, rng, scale, ratio)
        seen.append((h, w, *box))
        return box

    monkeypatch.setattr(module, "random_resized_box", spy)
    return seen


def _boxes_served(ds, draws, monkeypatch):
    """The random-resized-crop boxes the cached path (`ds[i]`) draws."""
    # where ds[i] draws a cached crop (read_cached_item)
    import recipes.vision.cache.cached_batches as module

    seen = spy_boxes(monkeypatch, module)
    torch.manual_seed(0)
    for k in range(draws):
        ds[k % len(ds)]
    return np.array(seen, dtype=float)


def assert_crops_follow_torchvision(served: np.ndarray, height: int, width: int) -> None:
    """Area, aspect and position of `served` boxes (rows of `spy_boxes`) against as many draws of
    torchvision's `RandomResizedCrop.get_params` on a `height x width` original (KS, alpha 0.001).
    """
    h, w, top, left, bh, bw = served.T
    torch.manual_seed(1)
    reference = np.array(
        [
            T.RandomResizedCrop.get_params(
                torch.empty(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3]
            )
            for _ in range(len(served))
        ],
        dtype=float,
    )
    rtop, rleft, rh, rw = reference.T
    ours = {
        "area": bh * bw / (h * w),
        "aspect": np.log(bw / bh),
        "x centre": (left + bw / 2) / w,
        "y centre": (top + bh / 2) / h,
    }
    theirs = {
        "area": rh * rw / (height * width),
        "aspect": np.log(rw / rh),
        "x centre": (rleft + rw / 2) / width,
        "y centre": (rtop + rh / 2) / height,
    }
    critical = 1.95 * np.sqrt(
        2 / len(served)
    )  # KS at alpha = 0.001 (results are seeded: no flakes)
    for name in ours:
        assert _ks(ours[name], theirs[name]) < critical, name


def _ks(a, b):
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    return np.abs(
        np.searchsorted(np.sort(a), grid, "right") / len(a)
        - np.searchsorted(np.sort(b), grid, "right") / len(b)
    ).max()


def test_train_crops_from_the_cache_follow_torchvision_over_the_original(tmp_path, monkeypatch):
    """2:1 photos: crops from the cache cover the whole image with torchvision's scale, ratio
    and position distribution (RandomResizedCrop.get_params on the original size), and reach
    the far left and right as often (a centre-square store never could)."""
    import cv2

    from recipes.testing import natural_image

    rng = np.random.default_rng(3)
    (tmp_path / "wide" / "a").mkdir(parents=True)
    for k in range(4):
        cv2.imwrite(str(tmp_path / "wide" / "a" / f"{k}.jpg"), natural_image(320, 640, rng))
    ds = ImageFolderFast(tmp_path / "wide", size=96, train=True)
    build_image_cache(ds, tmp_path / "c", num_workers=0, progress=False)
    served = _boxes_served(ds, 3000, monkeypatch)
    h, w, top, left, bh, bw = served.T
    assert set(zip(h, w, strict=True)) == {(96.0, 192.0)}  # whole images, aspect kept
    assert_crops_follow_torchvision(served, 320, 640)
    torch.manual_seed(1)
    rtop, rleft, rh, rw = np.array(
        [
            T.RandomResizedCrop.get_params(torch.empty(3, 320, 640), [0.08, 1.0], [3 / 4, 4 / 3])
            for _ in range(3000)
        ],
        dtype=float,
    ).T
    for ours_edge, theirs_edge in (
        ((left / w < 0.05).mean(), (rleft / 640 < 0.05).mean()),
        (((left + bw) / w > 0.95).mean(), ((rleft + rw) / 640 > 0.95).mean()),
    ):
        assert (
            ours_edge > 0.05 and abs(ours_edge - theirs_edge) < 0.03
        )  # the outer 5% strips, as often


def test_skip_build_stores_the_replacement_and_counts(own_tree, tmp_path):
    bad = own_tree / "class_01" / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    ds = ImageFolderFast(own_tree, size=64, on_error="skip")
    index = [p for p, _ in ds.samples].index(str(bad))
    cache = build_image_cache(ds, tmp_path, progress=False, num_workers=2)
    assert cache.skipped == (index,)
    reopened = ImageFolderFast(own_tree, size=64, on_error="skip", cache_dir=tmp_path)
    assert reopened.skipped == 1
    replacement = ImageFolderFast(own_tree, size=64)[(index + 1) % len(ds)]
    assert _mad(reopened[index][0], replacement[0]) < 3.0 and reopened[index][1] == replacement[1]


def test_build_raises_on_bad_file_by_default(own_tree, tmp_path):
    (own_tree / "class_00" / "bad.jpg").write_bytes(b"")
    from recipes.vision import ImageDecodeError

    with pytest.raises(ImageDecodeError, match="bad.jpg"):
        build_image_cache(
            ImageFolderFast(own_tree, size=64), tmp_path / "c", progress=False, num_workers=0
        )
    assert list((tmp_path / "c").iterdir()) == []  # nothing partial left


def test_cached_dataset_in_persistent_workers(own_tree, tmp_path):
    ds = ImageFolderFast(own_tree, size=64)
    build_image_cache(ds, tmp_path, progress=False, num_workers=0)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, persistent_workers=True, collate_fn=uint8_collate
    )
    first = torch.cat([b[0] for b in loader])
    second = torch.cat([b[0] for b in loader])
    assert torch.equal(first, second) and torch.equal(first[1], ds[1][0])


def test_cli_builds_the_same_cache(own_tree, tmp_path, capsys):
    assert (
        main(["cache", "vision", str(own_tree), str(tmp_path), "--size", "64", "--workers", "0"])
        == 0
    )
    assert "6 images, longer side at most 128" in capsys.readouterr().out
    ds = ImageFolderFast(own_tree, size=64, cache_dir=tmp_path)
    assert ds.cache is not None
    assert isinstance(ImageCache.open(ds.cache.path), ImageCache)


def test_cli_reports_a_bad_image_in_one_line(own_tree, tmp_path, capsys):
    (own_tree / "class_00" / "zz.jpg").write_bytes(b"<html>")
    assert main(["cache", "vision", str(own_tree), str(tmp_path), "--workers", "0"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("recipes cache: error:")]
    assert len(errors) == 1 and "zz.jpg" in errors[0], err
