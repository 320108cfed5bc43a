"""Image shards and the decoded-image cache (issue 27): the cache belongs to `ImageFolderFast`
(read back by it, by index, labels checked against its targets), so a `ShardSet` or a path is
refused with what to do instead, before anything is decoded or written."""

import cv2
import numpy as np
import pytest

from recipes.common.shards.shard_writer import write_shards
from recipes.vision.cache.image_cache_build import build_image_cache


def test_a_shard_set_or_a_path_is_refused_with_what_to_do(tmp_path):
    image = cv2.imencode(".jpg", np.full((8, 8, 3), 128, np.uint8))[1].tobytes()
    shards = write_shards(
        [{"__key__": f"k{i}", "jpg": image, "cls": i % 2} for i in range(4)],
        tmp_path / "s",
        progress=False,
    )
    for dataset in (shards, str(tmp_path / "s")):
        with pytest.raises(
            TypeError,
            match=r"must be an ImageFolderFast, but is .*ShardImages.*ImageFolderFast\(root\)",
        ):
            build_image_cache(dataset, tmp_path / "cache", num_workers=0, progress=False)
    assert not (tmp_path / "cache").exists()
