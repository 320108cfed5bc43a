"""Where `autotune` results live, and how `make_loader` finds them again.

Use when: you tuned once (`recipes tune` or `autotune()`) and want every later `make_loader`
for the same dataset, batch size and machine to use the measured settings.
Cost: one small JSON file per dataset and machine; a lookup is one `stat` and one read.
Adapt here: `dataset_key` (a dataset can define `tune_key()` to say what identifies it).
Trade-off: the key is the dataset's type, length and `repr` (ImageFolderFast's names its root,
size, mode and whether it reads a cache); two datasets that print alike share a result.
Files are `$RECIPES_TUNE_DIR`, else `$XDG_CACHE_HOME/recipes/tune` (`~/.cache/recipes/tune`).
Copy with: common/caches/cache_files.py, common/sizing/resources.py, common/sizing/sizing.py,
  common/workers/held_descriptors.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from recipes.common.caches.cache_files import fsync_path, write_synced
from recipes.common.sizing.sizing import local_world_size_from_env, resources_or_detect

FORMAT_VERSION = 1


def tune_dir() -> Path:
    explicit = os.environ.get("RECIPES_TUNE_DIR")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "recipes" / "tune"


def dataset_key(dataset) -> str:
    """What identifies a dataset for tuning: its `tune_key()`, else type, length and repr."""
    custom = getattr(dataset, "tune_key", None)
    if callable(custom):
        return str(custom())
    kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    try:
        length = str(len(dataset))
    except TypeError:
        length = "iterable"
    text = repr(dataset)
    if " object at 0x" in text:  # the default repr names a memory address, not the data
        text = ""
    return f"{kind}|{length}|{text}"


def machine_key(res=None) -> str:
    """This machine as the loader sees it: host name, effective CPUs, GPUs, ranks per node."""
    res = resources_or_detect(res)
    ranks = local_world_size_from_env()
    return f"{socket.gethostname()}|cpus={res.cpus}|gpus={res.gpus}|ranks={ranks}"


def _path(dataset, res=None) -> Path:
    digest = hashlib.sha256(
        f"v{FORMAT_VERSION}\n{dataset_key(dataset)}\n{machine_key(res)}".encode()
    ).hexdigest()
    return tune_dir() / f"{digest[:32]}.json"


def save_tuned(dataset, settings: dict[str, Any], measured: dict[str, Any]) -> Path:
    """Stores `settings` for `dataset` on this machine (atomically: temp file, fsync, rename)."""
    path = _path(dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "version": FORMAT_VERSION,
        "dataset": dataset_key(dataset),
        "machine": machine_key(),
        "settings": dict(settings),
        "samples_per_s": measured["samples_per_s"],
        "wait_fraction": measured.get("wait_fraction"),
        "peak_bytes": measured.get("peak_bytes"),
        "reason": getattr(settings, "reason", None),
        "step": getattr(settings, "step", None),
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_synced(tmp, json.dumps(record, indent=1).encode())
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path


def load_tuned(dataset, res=None) -> dict[str, Any] | None:
    """The stored record for `dataset` on this machine, or None (missing, other version, or
    unreadable: a damaged file is ignored, never trusted). `res`: a `Resources` snapshot."""
    try:
        path = _path(dataset, res)
        record = json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        return None
    if record.get("dataset") != dataset_key(dataset) or not isinstance(
        record.get("settings"), dict
    ):
        return None
    return record
