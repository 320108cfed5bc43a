"""Versioned JSON headers of cache folders, and size checks of their data files.

Use when: opening a cache folder written by a `build_*` step: the header names the format,
its version and the fingerprint of the inputs, and each data file's size follows from it.
A cache that fails any check is never served: the error says to rebuild it.
Cost: one small JSON read and one `stat` per data file.
Adapt here: nothing; each cache passes its own error type and rebuild hint.
Trade-off: sizes catch truncation, not bit flips inside a file (no checksum pass on open).
"""

from __future__ import annotations

import json
from pathlib import Path


def read_header(folder: Path, *, fmt: str, version: int, fingerprint: str | None, error: type[Exception],
                build_hint: str, fields: tuple[str, ...]) -> dict:
    """`folder/header.json`, checked for format, version, fingerprint and `fields`.

    Raises:
        error: unreadable, not an object, another format or version, another fingerprint,
            or missing fields; the message says how to rebuild.
    """
    try:
        header = json.loads((folder / "header.json").read_text())
    except (OSError, json.JSONDecodeError) as why:
        raise error(f"No readable cache at {folder} ({why}); build it with {build_hint}.") from None
    if not isinstance(header, dict) or not set(fields) <= set(header):
        raise error(f"{folder}/header.json is not a complete cache header; rebuild it with {build_hint}.")
    if header.get("format") != fmt or header.get("version") != version:
        raise error(f"{folder} holds format {header.get('format')} v{header.get('version')}, expected {fmt} "
                    f"v{version}; rebuild it with {build_hint}.")
    if fingerprint is not None and header.get("fingerprint") != fingerprint:
        raise error(f"{folder} was built from other inputs or settings; rebuild it with {build_hint}.")
    return header


def check_size(path: Path, expected: int, error: type[Exception]) -> None:
    """Raises `error` unless `path` exists with exactly `expected` bytes."""
    try:
        size = path.stat().st_size
    except OSError:
        raise error(f"{path} is missing; rebuild the cache.") from None
    if size != expected:
        raise error(f"{path} is {size} bytes, expected {expected} (truncated or corrupt); rebuild the cache.")
