"""Content checks of cache files: a checksum per item, written at build and verified on read.

Use when: a cache serves items (decoded images, tokens, features) from a memory map, and a
flipped bit on disk must never become a silently changed item. A build stores one 64-bit
checksum per item in `checksums.bin` and, in its header, one per small file (`file_checksums`:
offsets, shapes, labels, ... and `checksums.bin` itself), computed from the bytes it wrote.
`read_checked` verifies a small file when the cache opens; `ItemChecks` verifies an item's
bytes when it is read:
- "always": every read. Sees damage that happens while a process runs.
- "first_read" (the default): the first read of each item in each process (a numpy bool
  per item, never a Python list; a forked worker starts with none verified). Damage after
  that first read in a process is not seen.
- "never": no item check (the header, sizes and small files are still checked on open).
`verify_items` checks every item of a file at once (`recipes cache verify DIR`).
Cost: one hash of an item's bytes per check: xxh3-64 (`pip install xxhash`) ~60 GB/s, else
zlib's CRC32 ~2.3 GB/s (2.4 against 66 us per 150 KB eval image, measured on a 2-core VM);
"first_read" then a bool lookup per item. 8 bytes per item on disk.
Adapt here: `algorithm()`, the hash a build uses (the header records it; readers follow it).
Damage found is recorded: a failed item check (or `recipes cache verify`) writes `damaged.json`
in the cache folder (`record_damage`: atomic, best-effort; a read-only folder keeps none), and
opening a folder whose record names one of its files raises the cache's error
(`check_damage`), so the cache's `build_*` function, which rebuilds a cache that does not
open, replaces it instead of reusing it. A rebuild writes a new folder, without the record.
Trade-off: checksums find damage; they cannot repair it: a damaged item raises the cache's
error naming the file and item, and the fix is a rebuild.
Copy with: common/caches/cache_files.py, common/workers/held_descriptors.py.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from recipes.common.caches.cache_files import fsync_path, write_synced

VerifyMode = Literal["always", "first_read", "never"]
VERIFY_MODES = ("always", "first_read", "never")
_BLOCK = 1 << 24


def check_verify(verify: str) -> str:
    if verify not in VERIFY_MODES:
        raise ValueError(
            f"`verify` must be one of {', '.join(map(repr, VERIFY_MODES))}, but is {verify!r} "
            "instead."
        )
    return verify


def algorithm() -> str:
    """The item hash a build uses: "xxh3_64" when `xxhash` is installed, else "crc32"."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64"


def hasher(name: str, error: type[Exception] = ValueError) -> Callable[..., int]:
    """`hash(*buffers) -> int` for the header's `checksum` name: the hash of the buffers'
    bytes one after the other (C-contiguous numpy arrays or bytes)."""
    if name == "crc32":

        def crc(*parts) -> int:
            value = 0
            for part in parts:
                value = zlib.crc32(_bytes(part), value)
            return value

        return crc
    if name != "xxh3_64":
        raise error(
            f"Unknown cache checksum {name!r} (expected 'xxh3_64' or 'crc32'); rebuild the cache."
        )
    try:
        import xxhash
    except ImportError:
        raise error(
            "This cache was built with xxh3_64 checksums, which need xxhash to verify: "
            "pip install xxhash, or rebuild the cache here (it then uses CRC32)."
        ) from None

    def xxh(*parts) -> int:
        if len(parts) == 1:
            return xxhash.xxh3_64_intdigest(_bytes(parts[0]))
        state = xxhash.xxh3_64()
        for part in parts:
            state.update(_bytes(part))
        return state.intdigest()

    return xxh


def _bytes(part):
    return part.view(np.uint8).reshape(-1) if isinstance(part, np.ndarray) else part


def file_checksum(path: Path, name: str) -> str:
    """The hash of a whole file, streamed in 16 MiB blocks, as 16 hex digits."""
    hash_ = hasher(name)
    if name == "crc32":
        value = 0
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                value = zlib.crc32(block, value)
        return f"{value:016x}"
    return f"{hash_(Path(path).read_bytes()):016x}"  # xxh3 is fast; small files only


def file_checksums(folder: Path, names: tuple[str, ...], name: str) -> dict[str, str]:
    """`{file: checksum}` of the small files of a cache folder, for its header."""
    return {n: file_checksum(Path(folder) / n, name) for n in names}


def read_checked(
    folder: Path, name: str, dtype, header: dict, error: type[Exception], hint: str
) -> np.ndarray:
    """`folder/name` as a read-only array of `dtype`, after checking it against the header's
    `file_checksums[name]`.

    Raises:
        error: the file is unreadable or its checksum differs (damaged); says to rebuild.
    """
    path = Path(folder) / name
    try:
        data = path.read_bytes()
        expected = header["file_checksums"][name]
    except OSError as why:
        raise error(f"{path} is unreadable ({why}); rebuild the cache with {hint}.") from None
    except (KeyError, TypeError):
        raise error(
            f"{folder}/header.json has no checksum for {name}; rebuild the cache with {hint}."
        ) from None
    if f"{hasher(header['checksum'], error)(data):016x}" != expected:
        raise error(
            f"{path} is damaged (its checksum differs from the one header.json recorded at build); "
            f"rebuild the cache with {hint}."
        )
    return np.frombuffer(data, dtype=dtype)


class ItemChecks:
    """The per-item checksums of one data file, and which items this process has verified.

    Args:
        path: the data file (named in errors).
        sums: `uint64 [N]`, item i's checksum (from `read_checked(..., "checksums.bin")`).
        name: the hash (the header's `checksum`).
        verify: "always", "first_read" or "never" (see the module doc); settable later.
        error, hint: the cache's error type, and how to rebuild it.
    """

    def __init__(
        self,
        path: Path,
        sums: np.ndarray,
        name: str,
        *,
        verify: VerifyMode = "first_read",
        error: type[Exception] = ValueError,
        hint: str = "its build function",
        label: str = "item",
    ):
        self.path = Path(path)
        self.sums = sums
        self.name = name
        self.error = error
        self.hint = hint
        self.label = label
        self.verify = check_verify(verify)
        self._hash = hasher(name, error)
        self._pid: int | None = None
        self._verified: np.ndarray | None = None

    def _flags(self) -> np.ndarray:
        """This process's verified flags (a forked worker starts its own, all False)."""
        if self._pid != os.getpid():
            # See NOTE [copy-on-read] (common/caches/packed_strings.py): a numpy bool per item,
            # never a Python list or set
            self._verified = np.zeros(len(self.sums), bool)
            self._pid = os.getpid()
        return self._verified

    def needed(self, index: int) -> bool:
        """Whether a read of item `index` must be checked now."""
        return self.verify == "always" or (self.verify == "first_read" and not self._flags()[index])

    def pending(self, indices: np.ndarray) -> np.ndarray:
        """The ones of `indices` (an int array) a read must check now."""
        if self.verify == "never":
            return indices[:0]
        if self.verify == "always":
            return indices
        return indices[~self._flags()[indices]]

    def check(self, index: int, *parts) -> None:
        """Checks item `index`'s bytes (`parts`, one after the other) against its checksum.

        Raises:
            error: they differ: the file is damaged; names it, the item and the fix.
        """
        got = self._hash(*parts)
        if got != int(self.sums[index]):
            unrecorded = record_damage(self.path, [index], self.label)
            fix = (
                f"Rebuild the cache with {self.hint}, which replaces it (the damage is recorded in "
                f"{DAMAGE_RECORD})"
            )
            if unrecorded is not None:
                fix = (
                    f"The damage could not be recorded ({unrecorded}): remove "
                    f"{self.path.parent}, then rebuild it with {self.hint}"
                )
            raise self.error(
                f"{self.path} is damaged: {self.label} {index} has checksum {got:016x}, but "
                f"{int(self.sums[index]):016x} was written at build. {fix} (`recipes cache verify "
                f"{self.path.parent}` lists every damaged {self.label})."
            )
        if self.verify == "first_read":
            self._flags()[index] = True

    def __getstate__(self):
        return {**self.__dict__, "_pid": None, "_verified": None, "_hash": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._hash = hasher(self.name, self.error)


def verify_items(data: np.ndarray, bounds: np.ndarray, checks: ItemChecks) -> list[int]:
    """The items whose bytes `data[bounds[i]:bounds[i + 1]]` (a flat uint8 map) differ from
    their checksums: every item checked, none raising."""
    hash_ = hasher(checks.name, checks.error)
    bounds = np.asarray(bounds, np.int64)
    return [
        i
        for i in range(len(checks.sums))
        if hash_(data[bounds[i] : bounds[i + 1]]) != int(checks.sums[i])
    ]


def item_sums(name: str, items) -> np.ndarray:
    """`<u8 [N]` checksums of `items` (arrays or bytes), for a build's `checksums.bin`."""
    hash_ = hasher(name)
    return np.fromiter((hash_(item) for item in items), np.dtype("<u8"))


def write_item_sums(folder: Path, data_name: str, bounds: np.ndarray, name: str) -> None:
    """Writes `folder/checksums.bin`: the checksum of each item `data[bounds[i]:bounds[i + 1]]`
    of the data file `data_name` (byte offsets), read back once after the build wrote it."""
    path = Path(folder) / data_name
    bounds = np.asarray(bounds, np.int64)
    data = np.memmap(path, np.uint8, "r") if bounds[-1] else np.zeros(0, np.uint8)
    sums = item_sums(name, (data[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)))
    with open(Path(folder) / "checksums.bin", "wb") as f:
        f.write(sums.tobytes())
        f.flush()
        os.fsync(f.fileno())


DAMAGE_RECORD = "damaged.json"


def record_damage(path: Path, items: list[int], label: str = "item") -> str | None:
    """Adds "`items` of the data file `path` failed their checksums" to `path.parent/damaged.json`
    (written to a temp file, fsynced, renamed into place). Best-effort: returns None when
    recorded, else why not (a read-only folder). Two processes recording at once may keep
    one's entry only: either makes the folder damaged."""
    path = Path(path)
    record = path.parent / DAMAGE_RECORD
    try:
        entries = _read_record(path.parent)
        old = entries.get(path.name)
        if not isinstance(old, dict):
            old = {}
        found = sorted(set(old.get("items", [])) | {int(i) for i in items})
        if found == old.get("items"):  # recorded already (a damaged item read again)
            return None
        entries[path.name] = {
            "items": found,
            "label": label,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
        fd, temp = tempfile.mkstemp(prefix=f".{DAMAGE_RECORD}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            write_synced(Path(temp), json.dumps(entries, indent=1).encode("utf-8"))
            os.replace(temp, record)
        finally:
            Path(temp).unlink(missing_ok=True)
        fsync_path(path.parent)
    except OSError as why:
        return str(why)
    return None


def clear_damage(folder: Path, name: str) -> None:
    """Removes the record of damage to `folder/name` (a file just rebuilt in place: an eval
    view)."""
    entries = _read_record(folder)
    if name in entries:
        del entries[name]
        record = Path(folder) / DAMAGE_RECORD
        if not entries:
            record.unlink(missing_ok=True)
            return
        temp = record.with_name(f".{DAMAGE_RECORD}.{os.getpid()}.tmp")
        write_synced(temp, json.dumps(entries, indent=1).encode("utf-8"))
        os.replace(temp, record)


def _read_record(folder: Path) -> dict:
    """The entries of `folder/damaged.json` (none when absent; an unreadable record still
    counts)."""
    try:
        entries = json.loads((Path(folder) / DAMAGE_RECORD).read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {"?": "its damage record damaged.json is unreadable"}
    return entries if isinstance(entries, dict) else {}


def recorded_damage(folder: Path, names: tuple[str, ...]) -> str | None:
    """What `folder/damaged.json` records against the files `names`, or None: e.g. "tokens.bin
    sample 3 failed its checksum on 2025-01-02 03:04:05 UTC"."""
    entries = _read_record(folder)
    for name in (*names, "?"):
        entry = entries.get(name)
        if name == "?" and entry is not None:
            return str(entry)
        if isinstance(entry, dict):
            return _damage_line(name, entry)
    return None


def _damage_line(name: str, entry: dict) -> str:
    """One file's recorded damage, as `recorded_damage` says it."""
    items = [str(i) for i in entry.get("items", [])]
    shown = ", ".join(items[:10])
    if len(items) > 10:
        shown += ", ..."
    label = str(entry.get("label", "item"))
    checksums = "its checksum"
    if len(items) > 1:
        label += "s"
        checksums = "their checksums"
    return f"{name} {label} {shown} failed {checksums} on {entry.get('date', 'an unknown date')}"


def check_damage(folder: Path, names: tuple[str, ...], error: type[Exception], hint: str) -> None:
    """Raises `error` when `folder/damaged.json` records damage to one of the files `names`.

    Raises:
        error: "<folder> is damaged: <file> item <i> failed its checksum on <date>; rebuild it
            with <hint>, which replaces it."
    """
    found = recorded_damage(folder, names)
    if found is not None:
        raise error(
            f"{folder} is damaged: {found} ({DAMAGE_RECORD}); rebuild it with {hint}, which "
            "replaces it."
        )
