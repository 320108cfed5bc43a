"""CacheSource: what the decoded-image cache reads from the dataset it caches, named in one place.

Use when: building a decoded-image cache or its eval view (`build_image_cache`,
`ensure_eval_view`). Those take any object with the members below; `ImageFolderFast` has them.
The cache modules never import the dataset's module nor read its private fields: the dataset
imports the cache room, never the other way round.
Cost: nothing at run time: a `typing.Protocol`, for readers and type checkers.
Adapt here: a dataset of your own with these members can be cached (its items must be what
`cache_record` stores, read back by index); `ImageFolderFast.cache_record` and `eval_record`
say what an image and an eval-view row hold.
Trade-off: a structural interface: a missing member fails where it is first used
(`build_image_cache` checks `cache_record` up front, naming what it expected).
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if (
    TYPE_CHECKING
):  # the opened cache handed back by `use_cache`; image_cache.py never imports this file
    from recipes.vision.cache.image_cache import ImageCache


class CacheSource(Protocol):
    """A dataset a decoded-image cache is built from and read back by, index by index.

    Attributes:
        root: the folder its files are under (the cache records it, and names stale caches by it).
        max_side: the longer side, at most, of each stored image.
        train: False for an eval dataset, whose build also stores the eval view of its resolution.
        CROP_PCT: the eval crop (`Resize(size / CROP_PCT)` + `CenterCrop(size)`), which names the
            view.
    """

    root: str
    max_side: int
    train: bool
    CROP_PCT: float

    @property
    def paths(self) -> Sequence[str]:
        """The input files, in index order (their sizes and mtimes go into the fingerprint)."""
        ...

    @property
    def targets(self) -> np.ndarray:
        """`int64 [N]` class indices, stored as the cache's labels."""
        ...

    @property
    def resolution(self) -> tuple[int, int]:
        """The output (height, width): the eval view's size."""
        ...

    def __len__(self) -> int: ...

    def cache_record(self, index: int) -> tuple[np.ndarray, int, bool]:
        """`(uint8 [h, w, 3] C-contiguous, target, skipped)`: image `index` as the cache stores it,
        or (skipped=True) the image stored in place of a bad one."""
        ...

    def eval_record(self, index: int) -> torch.Tensor:
        """uint8 `[3, h, w]` at `resolution`: what the eval view stores at `index`."""
        ...

    def use_cache(self, cache: ImageCache) -> None:
        """Serves items from the opened `cache` from now on (after checking it against itself)."""
        ...
