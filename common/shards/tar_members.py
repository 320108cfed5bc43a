"""A WebDataset tar's members as bytes: written with fixed headers, parsed back in memory, and
grouped into samples by key.

Use when: writing a tar shard (`tar_sample`, `tar_end`: the bytes of a sample's members, and of
an archive's end), reading a range of one from its bytes (`tar_members`, `group_samples`), or
checking where its keys start (`tar_key_starts`, `tar_header_at`: the index's offsets).
Cost: one pass over the headers of the bytes at hand (plain ustar headers parsed by hand;
`tarfile` for PAX and GNU long names); no copy of a member unless its body is asked for.
Adapt here: nothing.
Trade-off: headers are fixed (mtime 0, uid/gid 0, mode 0444) so that the same samples give the
same bytes on every rank and every run. The grouping refuses what WebDataset refuses or would
read another way: a member twice in one sample, a key's members apart.
Copy with: common/shards/shard_samples.py.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator

from recipes.common.shards.shard_samples import ShardFormatError

BLOCK = 512
_RECORD = 20 * BLOCK  # tarfile's record size: an archive ends padded to it


def tar_sample(key: str, fields: list[tuple[str, bytes]]) -> bytes:
    """The tar members of one sample (`key.field` each), headers fixed so that the bytes depend
    on the sample only (tarfile's PAX headers: a plain ustar header unless a name needs more)."""
    parts = []
    for field, data in fields:
        info = tarfile.TarInfo(f"{key}.{field}")
        info.size = len(data)
        info.mtime = 0
        info.mode = 0o444
        info.uid = 0
        info.gid = 0
        info.uname = info.gname = ""
        parts += (
            info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"),
            data,
            b"\0" * (-len(data) % BLOCK),
        )
    return b"".join(parts)


def tar_end(size: int) -> bytes:
    """The end of an archive of `size` bytes of members: two zero blocks, then zeros up to a
    whole record, as tarfile writes it."""
    total = size + 2 * BLOCK
    return b"\0" * (2 * BLOCK + (-total) % _RECORD)


class NotUstar(Exception):
    """Tar bytes with extended headers (PAX, GNU long names): `tarfile` reads them."""


def tar_key_starts(data: bytes) -> tuple[list[int], int]:
    """Where each key's first member header starts in tar bytes (`read_tar`'s grouping; an
    extended header counts as its member's), and the byte up to which that is known: all of the
    data, or up to the last header before one that does not parse (damage: the checksums say so)."""
    found: list[tuple[int, str]] = []
    try:
        for at, name, _ in tar_members(data, bodies=False):
            found.append((at, name))
        known = len(data)
    except NotUstar:
        found, known = _tarfile_names(data)
    except ShardFormatError:
        known = _known_before(found)
    starts = []
    last = None
    for at, name in found:
        key = key_field(name)[0]
        if key is not None and key != last:
            starts.append(at)
            last = key
    return starts, known


def tar_header_at(data: bytes, pos: int) -> bool | None:
    """Whether a tar header starts at `pos`: True, False, or None for a damaged one (the ustar
    magic, but a header checksum that fails) or the end of the data."""
    header = data[pos : pos + BLOCK]
    field = header[148:156].split(b"\0", 1)[0].strip()
    if (
        len(header) == BLOCK
        and header.count(0) != BLOCK
        and field
        and set(field) <= set(b"01234567")
        and int(field, 8) == sum(header[:148]) + 8 * 32 + sum(header[156:BLOCK])
    ):
        return True
    if len(header) < BLOCK or header[257:262] == b"ustar":
        return None
    return False


def _tarfile_names(data: bytes) -> tuple[list[tuple[int, str]], int]:
    found: list[tuple[int, str]] = []
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        found = [(m.offset, m.name) for m in tar if m.isfile()]
    except tarfile.TarError:
        return found, 0
    clean = (
        data.count(0, tar.offset) == len(data) - tar.offset
    )  # tarfile stops quietly at a damaged header
    if clean:
        return found, len(data)
    return found, _known_before(found)


def _known_before(found: list[tuple[int, str]]) -> int:
    """The byte up to which headers are known when the one after the last `found` is damaged:
    just past the last found header's start."""
    if not found:
        return 0
    return found[-1][0] + 1


def tar_members(data: bytes, bodies: bool = True) -> Iterator[tuple[int, str, bytes | None]]:
    """`(header offset, name, bytes)` of the regular files in tar bytes with plain ustar/v7 headers;
    raises `NotUstar` for extended headers (PAX, GNU long names) and `ShardFormatError` for damage.
    """
    view = memoryview(data)
    pos = 0
    n = len(data)
    while pos + BLOCK <= n:
        header = data[pos : pos + BLOCK]
        if header[0] == 0 and header.count(0) == BLOCK:
            return  # the end-of-archive blocks
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            raise NotUstar
        stored = sum(header[:148]) + 8 * 32 + sum(header[156:BLOCK])
        try:
            checksum = int(header[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
            size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            raise ShardFormatError(f"a damaged tar header at byte {pos}") from None
        if checksum != stored:
            raise ShardFormatError(f"a damaged tar header at byte {pos} (checksum)")
        name = header[:100].split(b"\0", 1)[0]
        if header[257:262] == b"ustar" and header[345]:
            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
        body = pos + BLOCK
        if body + size > n:
            raise ShardFormatError(f"a tar member at byte {pos} runs past the end of the data")
        if kind in (b"0", b"\0", b"7"):
            content = None
            if bodies:
                content = bytes(view[body : body + size])
            yield (pos, name.decode("utf-8", "surrogateescape"), content)
        pos = body + size + (-size % BLOCK)
    if pos < n and data.count(0, pos) != n - pos:
        raise ShardFormatError(f"{n - pos} bytes at byte {pos} that are not a tar header")


def tarfile_members(data: bytes, path) -> list[tuple[int, str, bytes]]:
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        return [(m.offset, m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    except tarfile.ReadError as error:
        raise ShardFormatError(f"{path} is not a tar file ({error}).") from None


def group_samples(members, path) -> Iterator[tuple[int, dict]]:
    """`(first header offset, sample)` from `(offset, name, bytes)` members: adjacent members of
    one key, WebDataset's way."""
    current: dict | None = None
    seen: set[str] = set()
    first = 0
    for at, name, data in members:
        key, field = key_field(name)
        if key is None:
            continue  # WebDataset ignores members without an extension
        if current is None or current["__key__"] != key:
            if current is not None:
                yield first, current
            check_new_key(key, seen, path)
            current = {"__key__": key}
            first = at
        if field in current:
            raise duplicate_member(path, name)
        current[field] = data
    if current is not None:
        yield first, current


def key_field(name: str) -> tuple[str | None, str]:
    directory, base = os.path.split(name)
    if "." not in base:
        return None, ""
    stem, field = base.split(".", 1)
    if directory:
        return f"{directory}/{stem}", field
    return stem, field


def check_new_key(key: str, seen: set, path) -> None:
    if key in seen:
        raise ShardFormatError(
            f"{path}: the members of key {key!r} are not adjacent; a WebDataset tar groups each "
            "sample's files together (GNU tar: --sort=name)."
        )
    seen.add(key)


def duplicate_member(path, name: str) -> ShardFormatError:
    return ShardFormatError(
        f"{path}: the member {name!r} appears twice in one sample (webdataset refuses it as a "
        "duplicate file name; which copy is the sample's?). Rewrite the shard with one each."
    )
