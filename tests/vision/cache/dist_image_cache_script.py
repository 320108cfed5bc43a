"""Run under torchrun (2 gloo processes): build_image_cache split across ranks. With `die`, rank
1 exits midway through its share (as a killed node would)."""

import datetime
import os
import sys

import torch.distributed as dist

from recipes.vision import ImageFolderFast, build_image_cache


class DiesMidway(ImageFolderFast):
    def _cache_image(self, index):
        if dist.get_rank() == 1 and index == len(self) - 2:
            os._exit(3)
        return super()._cache_image(index)


def main(root: str, cache_dir: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    kind = DiesMidway if mode == "die" else ImageFolderFast
    ds = kind(root, size=64)
    cache = build_image_cache(ds, cache_dir, num_workers=0, progress=False, distributed=True)
    assert ds.cache is cache and ds[0][0].shape == (3, 64, 64)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
