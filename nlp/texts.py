"""Text inputs for the token cache: a list of strings, a .txt, .jsonl or .parquet file or fsspec
URL, or a Hugging Face `datasets.Dataset`.

Use when: reading a corpus line by line (or row by row) with errors that point at the line.
Cost: streaming; files are read twice when a cache is built (once to hash, once to tokenize);
a Parquet file row group by row group, only the `text_field` column.
Adapt here: `_parse_line` for another format.
Trade-off: one sample per line; multi-line samples need `.jsonl` or Parquet. A `datasets.Dataset`
is hashed by its own fingerprint when it has one (else by its texts).
Copy with: nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence

_KINDS = (".txt", ".jsonl", ".parquet")


class TextSource:
    """Samples from `texts` (see `build_token_cache`), in batches, with a content hash."""

    def __init__(self, texts, *, text_field: str = "text"):
        self.text_field = text_field
        if isinstance(texts, (str, os.PathLike)):
            self.url = os.fspath(texts)
            self.kind = _kind(self.url)
            self.strings = None
        elif _is_hf_dataset(texts):
            if text_field not in texts.column_names:
                raise ValueError(f"the dataset has no column {text_field!r} (its columns: {texts.column_names}); "
                                 "pass text_field= with the right name.")
            self.url, self.kind, self.strings = None, "datasets", texts
        elif isinstance(texts, Sequence):
            self.url, self.kind, self.strings = None, "strings", texts
        else:
            raise ValueError(f"`texts` must be a sequence of strings, a path or a URL, but is "
                             f"{type(texts).__name__} instead.")

    def describe(self) -> str:
        return self.url if self.url is not None else f"<{len(self.strings)} {self.kind}>"

    def content_hash(self) -> str:
        field = self.text_field if self.kind in (".jsonl", ".parquet", "datasets") else ""
        digest = hashlib.sha256(f"{self.kind}|{field}|".encode())
        if self.kind == "datasets" and getattr(self.strings, "_fingerprint", None):
            digest.update(str(self.strings._fingerprint).encode())
        elif self.kind == "datasets":
            for text in self._samples():
                data = text.encode("utf-8", "surrogatepass")
                digest.update(len(data).to_bytes(8, "little") + data)
        elif self.strings is not None:
            for i, text in enumerate(self.strings):
                if not isinstance(text, str):
                    raise ValueError(f"Sample {i} is {type(text).__name__}, not str.")
                data = text.encode("utf-8", "surrogatepass")
                digest.update(len(data).to_bytes(8, "little") + data)
        else:
            with self._open() as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()

    def batches(self, batch_size: int, *, part: int = 0, parts: int = 1) -> Iterator[list[str]]:
        """Samples in batches of `batch_size` (the last may be shorter). With `parts > 1`, only
        the batches `k` with `k % parts == part`; lines of the others are not parsed."""
        batch: list[str] = []
        for k, text in enumerate(self._samples(lambda k: k // batch_size % parts == part)):
            if k // batch_size % parts != part:
                continue
            batch.append(text)
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def _samples(self, wanted=lambda k: True) -> Iterator[str | None]:
        """Every sample in order; `None` for a line of a file that `wanted(k)` rejects."""
        if self.kind == "datasets":
            for k, record in enumerate(self.strings.select_columns([self.text_field])):
                yield self._checked(record[self.text_field], f"row {k}")
            return
        if self.strings is not None:
            yield from self.strings
            return
        if self.kind == ".parquet":
            yield from self._parquet_rows()
            return
        with self._open() as f:
            for number, raw in enumerate(f, start=1):
                yield self._parse_line(raw, number) if wanted(number - 1) else None

    def _parse_line(self, raw: bytes, number: int) -> str:
        line = raw[:-1] if raw.endswith(b"\n") else raw
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.url}, line {number}: invalid UTF-8 at byte {error.start} "
                             f"({line[max(0, error.start - 10):error.start + 10]!r}); re-encode the file "
                             "as UTF-8.") from None
        if self.kind == ".txt":
            return text
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{self.url}, line {number}: not JSON ({error.msg}); each line of a .jsonl "
                             "file must be one JSON object.") from None
        if not isinstance(record, dict) or self.text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{self.url}, line {number}: no field {self.text_field!r} (found {keys}); "
                             "pass text_field= with the right name.")
        value = record[self.text_field]
        if not isinstance(value, str):
            raise ValueError(f"{self.url}, line {number}: field {self.text_field!r} is "
                             f"{type(value).__name__}, not a string.")
        return value

    def _parquet_rows(self) -> Iterator[str]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError('Parquet texts need pyarrow: pip install "recipes[parquet]" (or pyarrow).') from None
        with self._open() as raw:
            try:
                file = pq.ParquetFile(raw)
            except Exception as error:  # pyarrow.ArrowInvalid and friends
                raise ValueError(f"{self.url} is not a Parquet file ({error}).") from None
            if self.text_field not in file.schema_arrow.names:
                raise ValueError(f"{self.url}: no column {self.text_field!r} (its columns: "
                                 f"{file.schema_arrow.names}); pass text_field= with the right name.")
            row = 0
            for group in range(file.num_row_groups):
                for text in file.read_row_group(group, columns=[self.text_field]).column(0).to_pylist():
                    yield self._checked(text, f"row {row}")
                    row += 1

    def _checked(self, value, where: str) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{self.describe()}, {where}: field {self.text_field!r} is {type(value).__name__}, "
                             "not a string.")
        return value

    def _open(self):
        import fsspec

        return fsspec.open(self.url, "rb", compression="infer").open()


def _is_hf_dataset(texts) -> bool:
    """A Hugging Face `datasets.Dataset` (not a dependency: recognised by its module and columns)."""
    return type(texts).__module__.startswith("datasets.") and hasattr(texts, "column_names")


def _kind(url: str) -> str:
    name = url.split("?")[0].lower()
    for compression in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(compression):
            name = name[: -len(compression)]
    for kind in _KINDS:
        if name.endswith(kind):
            return kind
    raise ValueError(f"{url}: unknown text file type; use .txt (one sample per line), .jsonl "
                     "(one JSON object per line) or .parquet (`text_field` column), or pass a list of strings.")
