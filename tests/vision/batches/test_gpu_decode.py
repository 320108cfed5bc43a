"""decode="gpu" (issue #12): workers read bytes and draw the crops, `GpuDecode` decodes, crops and
normalises batches on the device. Without CUDA the same steps run with device="cpu" and must
give the CPU path's images; the CUDA run is a `gpu` test."""

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms as T
from PIL import Image

from recipes.common import make_loader
from recipes.testing import make_image_folder
from recipes.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DeviceNormalize,
    GpuDecode,
    ImageDecodeError,
    ImageFolderFast,
    encoded_collate,
)
from tests.vision.test_image_folder import _mode_files


@pytest.fixture
def pretend_cuda(monkeypatch):
    """The dataset only refuses decode="gpu" without CUDA; its workers never touch the device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _grey(a, b):
    """Mean |a - b| per image of normalised batches, in grey levels."""
    return ((a - b) * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255).abs().flatten(1).mean(1)


def _normalised(images_uint8):
    return DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD, device="cpu")(images_uint8)


def _torchvision_eval(root, size):
    """torchvision's eval pipeline (Pillow decode, Resize, CenterCrop): the independent
    reference."""
    ref = torchvision.datasets.ImageFolder(
        root,
        transform=T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.PILToTensor()]),
    )
    return _normalised(torch.stack([ref[i][0] for i in range(len(ref))]))


def test_without_cuda_the_gpu_path_says_to_use_the_cpu_path(image_tree):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(RuntimeError, match="decode='gpu' needs CUDA.*use the CPU path"):
        ImageFolderFast(image_tree, decode="gpu")
    with pytest.raises(RuntimeError, match="CUDA is not available.*decode='cpu'"):
        GpuDecode(ImageFolderFast(image_tree), device="cuda")
    with pytest.raises(ValueError, match="`decode` must be 'cpu' or 'gpu'"):
        ImageFolderFast(image_tree, decode="nvjpeg")


def test_eval_batches_through_workers_are_torchvisions_eval(image_tree, pretend_cuda):
    encoded = ImageFolderFast(image_tree, size=96, decode="gpu")
    loader = make_loader(
        encoded, batch_size=5, num_workers=2, pin_memory=False, collate_fn=encoded_collate
    )
    to_images = GpuDecode(encoded, device="cpu")
    images, targets = zip(*(to_images(batch) for batch in loader), strict=True)
    images, targets = torch.cat(images), torch.cat(targets)
    assert images.shape == (len(encoded), 3, 96, 96) and images.is_contiguous(
        memory_format=torch.channels_last
    )
    assert targets.tolist() == encoded.targets.tolist()
    grey = _grey(images, _torchvision_eval(image_tree, 96))
    assert grey.max() < 3.0 and grey.mean() < 2.0, grey


def test_train_crops_and_flips_are_drawn_like_the_cpu_path(image_tree, pretend_cuda):
    encoded = ImageFolderFast(image_tree, size=64, train=True, decode="gpu")
    cpu = ImageFolderFast(image_tree, size=64, train=True)
    torch.manual_seed(0)
    batch = encoded_collate([encoded[i] for i in range(8)])
    torch.manual_seed(0)  # the CPU path draws the same boxes and flips from the same seed
    cpu_images = torch.stack([cpu[i][0] for i in range(8)])
    images, _ = GpuDecode(encoded, device="cpu")(batch)
    assert batch["flips"].any() and not batch["flips"].all()
    reference = []  # Pillow: the whole image, the batch's box, an antialiased resize, the flip
    for (path, _), (top, left, h, w), flip in zip(
        encoded.samples[:8], batch["boxes"].tolist(), batch["flips"].tolist(), strict=True
    ):
        with Image.open(path) as im:
            crop = (
                im.convert("RGB")
                .crop((left, top, left + w, top + h))
                .resize((64, 64), Image.BILINEAR)
            )
        tensor = torch.from_numpy(np.asarray(crop)).permute(2, 0, 1)
        reference.append(tensor.flip(-1) if flip else tensor)
    assert _grey(images, _normalised(torch.stack(reference))).max() < 2.0
    assert _grey(images, _normalised(cpu_images)).max() < 6.0  # the CPU path decodes DCT-scaled


def test_other_modes_fall_back_to_the_cpu_decoder(tmp_path, pretend_cuda):
    root = _mode_files(tmp_path)
    encoded = ImageFolderFast(root, size=64, decode="gpu")
    batch = encoded_collate([encoded[i] for i in range(len(encoded))])
    paths = [p for p, _ in encoded.samples]
    assert batch["jpeg"].tolist() == [p.endswith(".jpg") for p in paths]
    images, _ = GpuDecode(encoded, device="cpu")(batch)
    grey = dict(zip(paths, _grey(images, _torchvision_eval(root, 64)).tolist(), strict=True))
    del grey[str(root / "m" / "gray16.png")]  # Pillow clips 16-bit to 255 instead of scaling
    assert max(grey.values()) < 3.0, grey


def test_bad_files_raise_or_are_skipped_in_the_workers(tmp_path, pretend_cuda):
    root = make_image_folder(tmp_path / "t", classes=2, per_class=3, seed=2)
    good = next(root.rglob("*.jpg")).read_bytes()
    (root / "class_00" / "cut.jpg").write_bytes(good[: len(good) // 2])
    with pytest.raises(ImageDecodeError, match="cut.jpg.*truncated JPEG"):
        list(
            make_loader(
                ImageFolderFast(root, decode="gpu"),
                batch_size=4,
                num_workers=2,
                pin_memory=False,
                collate_fn=encoded_collate,
            )
        )
    skipping = ImageFolderFast(root, decode="gpu", on_error="skip")
    batches = list(
        make_loader(
            skipping, batch_size=4, num_workers=2, pin_memory=False, collate_fn=encoded_collate
        )
    )
    assert sum(len(b["targets"]) for b in batches) == 7 and skipping.skipped == 1
    with pytest.raises(ValueError, match="decoded cache"):
        ImageFolderFast(root, decode="gpu", cache_dir=tmp_path / "c")


@pytest.mark.gpu
def test_cuda_decode_equals_the_cpu_run(image_tree):
    encoded = ImageFolderFast(image_tree, size=96, train=True, decode="gpu")
    torch.manual_seed(0)
    batch = encoded_collate([encoded[i] for i in range(len(encoded))])
    on_cpu, _ = GpuDecode(encoded, device="cpu")(batch)
    on_gpu, _ = GpuDecode(encoded, device="cuda")(batch)
    assert _grey(on_gpu.cpu(), on_cpu).max() < 2.0


def _cpu_boxes_and_flips(ds, monkeypatch):
    """Records, per index, the source box the CPU path decoded and whether it flipped."""
    seen = {}
    decode_box, finish = ImageFolderFast._decode_box, ImageFolderFast._finish

    def spy_decode(self, data, header, box, out, path, index):
        seen[index] = [tuple(box)]
        return decode_box(self, data, header, box, out, path, index)

    def spy_finish(self, image, rng=None):
        result = finish(self, image, rng)
        seen[max(seen)].append(not torch.equal(result, image))
        return result

    monkeypatch.setattr(ImageFolderFast, "_decode_box", spy_decode)
    monkeypatch.setattr(ImageFolderFast, "_finish", spy_finish)
    return seen


@pytest.mark.parametrize("bad", ["truncated", "not_an_image", "empty"])
def test_skipping_a_bad_file_leaves_both_paths_with_the_same_crops(
    tmp_path, pretend_cuda, monkeypatch, bad
):
    """A bad file in the middle of a train epoch: the CPU path draws the crop before it finds
    the damage (it decodes the box), decode="gpu" workers check the bytes first; the bad file
    must consume no randomness on either, so every later image gets the same crop and flip."""
    root = make_image_folder(tmp_path / "t", classes=2, per_class=4, seed=3)
    good = (root / "class_00" / "img_0001.jpg").read_bytes()
    broken = {
        "truncated": good[: len(good) // 2],
        "not_an_image": b"<html>404</html>",
        "empty": b"",
    }[bad]
    (root / "class_00" / "img_0001b.jpg").write_bytes(broken)  # index 2 of 9
    cpu = ImageFolderFast(root, size=48, train=True, on_error="skip", region_decode=False)
    encoded = ImageFolderFast(root, size=48, train=True, on_error="skip", decode="gpu")
    seen = _cpu_boxes_and_flips(cpu, monkeypatch)
    torch.manual_seed(0)
    cpu_items = []
    for i in range(len(cpu)):
        seen.clear()
        cpu[i]
        cpu_items.append(seen[max(seen)])
    torch.manual_seed(0)
    gpu_items = [encoded[i][0] for i in range(len(encoded))]
    assert cpu.skipped == encoded.skipped == 1 and cpu.skipped_indices().tolist() == [2]
    for i, ((box, flip), item) in enumerate(zip(cpu_items, gpu_items, strict=True)):
        assert (box, flip) == (tuple(item["box"].tolist()), item["flip"]), i
    assert gpu_items[2]["index"] == 3  # the next good image in the bad one's place
