"""Row packing: documents' tokens concatenated and cut into rows of exactly `seq_len` tokens, a
document cut at a row's end carried into the next row.

Use when: a stream of documents (tokenized on the fly) must become fixed-length rows with their
document boundaries, no token lost or repeated (`packed_text_stream.py`).
Cost: one encode call per `batch` documents (a fast tokenizer's Rust batch encoder, which
releases the GIL), then numpy slices: O(tokens).
Adapt here: `pack_rows` (another cut rule, such as never cutting a short document).
Trade-off: rows are filled greedily in stream order (no best-fit: that needs the lengths ahead,
`pack_plan.py` over a token cache); a document longer than the room left is cut, its rest
starting the next row as a new piece (its positions restart at 0, as `PackCollate`'s pieces do).
Copy with: nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np


class Part(NamedTuple):
    """A document to pack from its token `start` on (0: whole; more: the rest of a document cut
    at an earlier row's end)."""

    document: Any  # the source's item: a dict with the text and a stable id
    start: int


class Piece(NamedTuple):
    """A document's tokens in one row: `tokens` are its tokens `start` to `start + len`."""

    doc_id: Any
    start: int
    tokens: np.ndarray  # int64


class Cursor(NamedTuple):
    """Where a consumer's stream of parts stands: the part of the next token, and the tokens of
    that part already in rows past the part's `start`. `Cursor(0, 0)`: nothing packed yet."""

    part: int
    taken: int


class Row(NamedTuple):
    """One packed row (its pieces fill `seq_len`, but in the stream's last row), and the cursor
    after it."""

    pieces: list[Piece]
    end: Cursor


class TokenizedPart(NamedTuple):
    """A part's tokens from its `start` on."""

    doc_id: Any
    start: int
    tokens: np.ndarray  # int64


def tokenized(
    parts: Iterable[Part],
    encode: Callable[[list[str]], list[list[int]]],
    *,
    text_key: str,
    id_key: str | tuple[str, ...],
    batch: int,
    suffix: tuple[int, ...] = (),
) -> Iterator[TokenizedPart]:
    """Each part's tokens from its start on, `batch` documents encoded per call; `suffix` (an
    EOS id) ends every document.

    Raises:
        KeyError: a document without `text_key` or `id_key`.
    """
    parts = iter(parts)
    while True:
        chunk = list(itertools.islice(parts, batch))
        if not chunk:
            return
        texts = [_field(part.document, text_key) for part in chunk]
        for part, ids in zip(chunk, encode(texts), strict=True):
            tokens = np.asarray(list(ids) + list(suffix), dtype=np.int64)
            yield TokenizedPart(_field(part.document, id_key), part.start, tokens[part.start :])


def pack_rows(parts: Iterable[TokenizedPart], seq_len: int) -> Iterator[Row]:
    """Rows of exactly `seq_len` tokens over `parts` back to back, the last one shorter (the
    caller pads it); each row's `end` is the cursor after it, in the parts' indices."""
    pieces: list[Piece] = []
    used = 0
    count = 0
    for index, part in enumerate(parts):
        count = index + 1
        size = len(part.tokens)
        taken = 0
        while taken < size:
            take = min(seq_len - used, size - taken)
            tokens = part.tokens[taken : taken + take]
            pieces.append(Piece(part.doc_id, part.start + taken, tokens))
            used += take
            taken += take
            if used == seq_len:
                end = Cursor(index + 1, 0)
                if taken < size:
                    end = Cursor(index, taken)
                yield Row(pieces, end)
                pieces = []
                used = 0
    if pieces:
        yield Row(pieces, Cursor(count, 0))


def _field(document, key: str | tuple[str, ...]):
    """`document[key]`; for a tuple of keys (an id over several fields, as a corpus's
    `("file", "row")`), the tuple of their values."""
    try:
        if isinstance(key, tuple):
            return tuple(document[k] for k in key)
        return document[key]
    except (KeyError, TypeError, IndexError):
        raise KeyError(
            f"A document has no {key!r}: {document!r:.120}; pass the key its text or id is under "
            "(`text_key=`, `id_key=`)."
        ) from None
