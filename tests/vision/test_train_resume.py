"""Train crops resume exactly: a loader resumed from `state_dict()` (in a fresh dataset, fresh
workers) yields the crops and flips, not only the indices, of the uninterrupted run, on every
path make_loader takes: worker processes, no workers, threads."""

import json

import pytest
import torch

from recipes.common import make_loader
from recipes.vision import ImageFolderFast

PATHS = [
    {"path": "workers", "num_workers": 2},
    {"path": "workers", "num_workers": 0},
    {"path": "threads"},
]


def _loader(root, options):
    return make_loader(
        ImageFolderFast(root, size=48, train=True),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        **options,
    )


@pytest.mark.parametrize(
    "options", PATHS, ids=lambda o: f"{o['path']}-{o.get('num_workers', 'default')}"
)
@pytest.mark.parametrize(
    "cut", [pytest.param(0, marks=pytest.mark.slow), 1]
)  # epoch 1: its start, one batch in
def test_a_resumed_epoch_draws_the_crops_the_uninterrupted_one_drew(image_tree, options, cut):
    loader = _loader(image_tree, options)
    list(loader)  # epoch 0
    epoch1 = iter(loader)
    for _ in range(cut):
        next(epoch1)
    state = json.loads(json.dumps(loader.state_dict()))
    rest = list(epoch1)
    resumed = _loader(image_tree, options)  # a fresh dataset: no generator, no file checked yet
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) > 0
    for i, ((x, y), (rx, ry)) in enumerate(zip(rest, again, strict=True)):
        assert torch.equal(y, ry), i
        assert torch.equal(x, rx), (i, (x.float() - rx.float()).abs().mean().item())


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"path": "workers", "num_workers": 2, "persistent_workers": True}, {"path": "threads"}],
    ids=["workers-persistent", "threads"],
)
def test_on_photographs_a_resume_in_epoch_2_draws_the_uninterrupted_crops(tmp_path, options):
    """The same on the photographic set (every JPEG kind, sizes from thumbnails to megapixels,
    so every DCT scale and region decode), resumed three batches into epoch 2 of persistent
    workers."""
    from recipes.testing import make_photo_folder

    root = make_photo_folder(tmp_path / "photos", images=24, classes=3, seed=4)

    def loader():
        return make_loader(
            ImageFolderFast(root, size=64, train=True),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),
            **options,
        )

    first = loader()
    list(first), list(first)  # epochs 0 and 1
    epoch2 = iter(first)
    for _ in range(3):
        next(epoch2)
    state = json.loads(json.dumps(first.state_dict()))
    rest = list(epoch2)
    resumed = loader()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) == 3
    for i, ((x, y), (rx, ry)) in enumerate(zip(rest, again, strict=True)):
        assert torch.equal(y, ry) and torch.equal(x, rx), i
