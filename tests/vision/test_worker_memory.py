"""Worker memory stays flat across epochs (issue #10): ImageFolderFast in train mode, 2
persistent workers; USS from epoch 2 to epoch 10 grows under 5%."""

import psutil

from recipes.common import make_loader
from recipes.testing import make_image_folder
from recipes.vision import ImageFolderFast, uint8_collate


def test_worker_uss_is_flat_from_epoch_2_to_10(tmp_path):
    root = make_image_folder(tmp_path, classes=4, per_class=60, seed=5)
    ds = ImageFolderFast(root, size=160, train=True)
    loader = make_loader(ds, batch_size=32, shuffle=True, num_workers=2, persistent_workers=True,
                         collate_fn=uint8_collate)
    uss = []
    for _ in range(11):
        iterator = iter(loader)
        for _ in iterator:
            pass
        uss.append(sum(psutil.Process(w.pid).memory_full_info().uss for w in iterator._workers))
    growth = uss[10] / uss[2] - 1
    assert growth < 0.05, [round(u / 2**20, 1) for u in uss]
