"""`recipes cache verify DIR`: check every item of a cache folder against its checksums.

Opening a cache checks its header and small files; this reads every item of its data files
(and, for an image cache, of each eval view) and lists the damaged ones, so damage that
`verify="first_read"` would meet only when an item is first read is found before training.
Exit status 0 when everything matches, 1 otherwise (each damaged file and item named). Damage
found is recorded in the folder's `damaged.json`
(`recipes.common.caches.cache_checks.record_damage`), as a read that finds it does: the cache then
fails to open, and its `build_*` function rebuilds it (an eval view's damage: that view alone)
instead of reusing it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from recipes.audio.spectrogram_cache import SpectrogramCache
from recipes.common.caches.cache_checks import record_damage, verify_items
from recipes.nlp.token_cache import TokenCache
from recipes.vision.cache.eval_view import find_eval_view
from recipes.vision.cache.image_cache import ImageCache, ImageCacheError


def cache_folders(path: Path) -> list[Path]:
    """`path` itself when it is a cache folder (a `header.json`), else its `images-*` caches."""
    if (path / "header.json").exists():
        return [path]
    return sorted(p for p in path.glob("images-*") if p.is_dir() and (p / "header.json").exists())


def _flat(path: Path) -> np.ndarray:
    return np.memmap(path, np.uint8, "r") if path.stat().st_size else np.zeros(0, np.uint8)


def check_folder(folder: Path) -> tuple[int, list[str]]:
    """`(items checked, problems)` of one cache folder; a problem names the file (and item)."""
    try:
        fmt = json.loads((folder / "header.json").read_bytes()).get("format")
    except (OSError, ValueError, AttributeError) as why:
        return 0, [f"{folder}/header.json is damaged ({why}); rebuild the cache."]
    try:
        parts = _data_files(folder, fmt)
    except ValueError as why:  # the caches' errors are ValueErrors that say what is wrong
        return 0, [str(why)]
    checked = 0
    problems = []
    for item in parts:
        if isinstance(item, str):
            problems.append(item)
            continue
        path, bounds, checks = item
        bad = verify_items(_flat(path), bounds, checks)
        checked += len(checks.sums)
        # recorded, so that the build function rebuilds the cache (or view) instead of reusing it
        if bad:
            shown = ", ".join(map(str, bad[:20]))
            if len(bad) > 20:
                shown += ", ..."
            unrecorded = record_damage(path, bad, checks.label)
            fix = f"recorded in damaged.json; rebuild with {checks.hint}"
            if unrecorded is not None:
                fix = (
                    f"not recorded ({unrecorded}): remove {folder}, then rebuild with {checks.hint}"
                )
            problems.append(
                f"{path}: {len(bad)} of {len(checks.sums)} {checks.label}s damaged: {shown}; {fix}"
            )
    return checked, problems


def _data_files(folder: Path, fmt) -> list:
    """`(data file, byte bounds [N + 1], ItemChecks)` per data file, or a problem's text."""
    if fmt == "recipes-token-cache":
        cache = TokenCache.open(folder)
        return [
            (
                folder / "tokens.bin",
                cache.offsets * np.dtype(cache.header["dtype"]).itemsize,
                cache.checks,
            )
        ]
    if fmt == "recipes-spectrogram-cache":
        cache = SpectrogramCache.open(folder)
        size = cache.n_mels * np.dtype(cache.header["dtype"]).itemsize
        return [(folder / "features.bin", cache.offsets * size, cache.checks)]
    if fmt == "recipes-image-cache":
        cache = ImageCache.open(folder)
        parts = [(folder / "images.bin", cache.offsets, cache.checks)]
        for header in sorted(folder.glob("eval-*.json")):
            match = re.fullmatch(r"eval-(\d+)x(\d+)-crop([0-9.]+)\.json", header.name)
            if match is None:
                parts.append(f"{header}: not an eval view name")
                continue
            h = int(match[1])
            w = int(match[2])
            view, why = find_eval_view(
                folder, cache.fingerprint, cache.count, (h, w), float(match[3]), ImageCacheError
            )
            if view is None:
                parts.append(
                    f"{header}: {why}; rebuild it with build_image_cache() on an eval dataset of "
                    f"size {(h, w)}."
                )
            else:
                parts.append((view.path, np.arange(cache.count + 1) * (h * w * 3), view.checks))
        return parts
    return [f"{folder}/header.json names no known cache format ({fmt!r}); is it a recipes cache?"]


def run(args) -> int:
    folders = cache_folders(args.cache_dir)
    if not folders:
        raise ValueError(
            f"No cache at {args.cache_dir}: expected a cache folder (with header.json) or a folder "
            "of image caches (images-*/)."
        )
    total = 0
    failed = False
    for folder in folders:
        checked, problems = check_folder(folder)
        total += checked
        for problem in problems:
            print(f"DAMAGED {problem}")
        verdict = "ok"
        if problems:
            failed = True
            verdict = "damaged"
        print(f"{folder}: {checked:,} items checked, {verdict}")
    return int(failed)
