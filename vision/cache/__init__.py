"""The decoded-image cache: every image decoded once, stored on disk, served by index.

Lives here: `cache_source.py` (`CacheSource`, the dataset's side the cache reads: the one
interface between a dataset and its cache), `image_cache.py` (`ImageCache`, an opened cache
folder), `image_cache_build.py` (`build_image_cache`, the fingerprint, attaching the cache built
from a dataset's inputs), `eval_view.py` (rows of torchvision's eval pixels beside the cache,
opened), `eval_view_build.py` (such a view decoded and written), `stale_caches.py` (what changed
since a cache was built), `cached_batches.py` (whole batches and items cut from the cache) and
`cached_items.py` (`CachedItems`: the cache as a dataset serves it, with its eval views).
May import: `recipes.common` (the cache-file protocol, checksums), `recipes.vision.decoding` and
this room; never `image_folder.py` nor a dataset's private fields (the datasets import this room).
"""
