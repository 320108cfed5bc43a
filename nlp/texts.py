"""Text inputs for the token cache: a list of strings; a .txt, .jsonl or .parquet file or fsspec
URL; a folder, a glob or a list of `pathlib.Path`s of such files; a `ShardSet` (or its folder);
or a Hugging Face `datasets.Dataset`.

Use when: reading a corpus line by line (or row by row) with errors that point at the line.
Cost: streaming; files are read twice when a cache is built (once to hash, once to tokenize);
a Parquet file row group by row group, only the `text_field` column. A shard set is hashed from
its index (each shard's sha256: no read) and each shard is checked against it as it is read.
A shard file named alone (a path, a glob's match, a `Path` of a list) that its folder's index
lists is read the same way, through its set: never as a plain Parquet file, unchecked.
Adapt here: `_parse_line` for another format.
Trade-off: one sample per line; multi-line samples need `.jsonl` or Parquet. A `datasets.Dataset`
is hashed by its own fingerprint when it has one (else by its texts). A list of strings is
texts, never paths: one whose strings are all existing paths is refused (issue 27); pass
`Path`s, a folder or a glob to read files.
Copy with: common/caches/cache_folder.py, common/caches/packed_strings.py,
  common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_content.py, common/shards/shard_formats.py, common/shards/shard_index.py,
  common/shards/shard_samples.py, common/shards/shard_set.py, common/shards/sharded_dataset.py,
  common/shards/tar_members.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence

from recipes.common.shards.shard_content import content_hash as shard_set_hash
from recipes.common.shards.shard_content import listed_shard, read_checked
from recipes.common.shards.shard_set import ShardSet

_KINDS = (".txt", ".jsonl", ".parquet")


class TextSource:
    """Samples from `texts` (see `build_token_cache`), in batches, with a content hash."""

    def __init__(self, texts, *, text_field: str = "text"):
        self.text_field = text_field
        self.url = self.strings = self.shards = self.files = None
        if isinstance(texts, ShardSet):
            self._take_shards(texts)
        elif isinstance(texts, (str, os.PathLike)):
            self.url = os.fspath(texts)
            self._take_url()
        elif _is_hf_dataset(texts):
            if text_field not in texts.column_names:
                raise ValueError(
                    f"the dataset has no column {text_field!r} (its columns: "
                    f"{texts.column_names}); pass text_field= with the right name."
                )
            self.kind = "datasets"
            self.strings = texts
        elif (
            isinstance(texts, Sequence)
            and len(texts)
            and all(isinstance(t, os.PathLike) for t in texts)
        ):
            sets: dict = {}
            self.kind = "files"
            self.files = [_source(os.fspath(t), text_field, sets) for t in texts]
        elif isinstance(texts, Sequence):
            _refuse_paths(texts)
            self.kind = "strings"
            self.strings = texts
        else:
            raise ValueError(
                f"`texts` must be a sequence of strings, a path, a URL or a ShardSet, but is "
                f"{type(texts).__name__} instead."
            )

    def _take_url(self) -> None:
        """A file (by its suffix), else a glob, a shard set's folder or a folder of text files."""
        # "?" starts a URL's query, a glob pattern only in a local path
        magic = any(c in self.url for c in "*[") or ("?" in self.url and "://" not in self.url)
        if not magic:
            # a shard file alone: read through its set's index, every sample checked
            shard = listed_shard(self.url, {})
            if shard is not None:
                self._take_shards(shard)
                return
        if not magic and _known(self.url):
            self.kind = _kind(self.url)
            return
        import fsspec

        fs, path = fsspec.core.url_to_fs(self.url)
        if not magic and not fs.isdir(path):
            _kind(self.url)  # raises: an unknown file type
        if not magic and fs.exists(f"{path.rstrip('/')}/index.json"):
            self._take_shards(ShardSet.open(self.url))
            return
        if magic:
            found = sorted(fs.glob(path))
        else:
            found = sorted(fs.ls(path, detail=False))
        if "://" in self.url:  # remote: the listing's paths back as URLs
            found = [fs.unstrip_protocol(p) for p in found]
        sets = {}
        shards = {p: listed_shard(p, sets) for p in found if p.endswith((".tar", ".parquet"))}
        names = [
            p
            for p in found
            if (_known(p) or shards.get(p))
            and not p.rstrip("/").rsplit("/", 1)[-1].startswith((".", "_"))
        ]
        if not names:
            where = "in it"
            if magic:
                where = "match"
            raise ValueError(
                f"{self.url}: no .txt, .jsonl or .parquet files {where} "
                f"({len(found)} other entries); pass a file, a folder or a glob of text files, "
                "or ShardSet.open(url) for shards."
            )
        if not magic and any(
            re.fullmatch(r"shard-\d{6}\.\w+", n.rsplit("/", 1)[-1]) for n in names
        ):
            raise ValueError(
                f"{self.url} holds shards but no index.json (a write_shards() in progress, or "
                "killed midway): rerun write_shards(), or index_shards() for other tools' shards."
            )
        self.kind = "files"  # a shard of a set (beside its index, listed in it): through the set
        self.files = [TextSource(shards.get(p) or p, text_field=self.text_field) for p in names]

    def _take_shards(self, shards) -> None:
        if (
            shards.format == "parquet"
            and shards.columns
            and self.text_field not in [c for c, _ in shards.columns]
        ):
            raise ValueError(
                f"{shards.url}: its shards have no column {self.text_field!r} (their columns: "
                f"{[c for c, _ in shards.columns]}); pass text_field= with the right name."
            )
        self.kind = "shards"
        self.shards = shards
        self.url = shards.url

    def describe(self) -> str:
        if self.url is not None:
            return self.url
        if self.files is not None:
            return f"<{len(self.files)} files>"
        return f"<{len(self.strings)} {self.kind}>"

    def content_hash(self) -> str:
        field = ""
        if self.kind in (".jsonl", ".parquet", "datasets", "shards"):  # kinds with a text field
            field = self.text_field
        digest = hashlib.sha256(f"{self.kind}|{field}|".encode())
        if self.shards is not None:  # from the index: no shard is read
            digest.update(shard_set_hash(self.shards, field).encode())
        elif self.files is not None:  # each file's own hash, in order
            for part in self.files:
                digest.update(part.content_hash().encode())
        elif self.kind == "datasets" and getattr(self.strings, "_fingerprint", None):
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
        if self.files is not None:  # `wanted` counts samples across the files
            done = 0
            for part in self.files:
                for text in part._samples(lambda k, before=done: wanted(before + k)):
                    done += 1
                    yield text
            return
        if self.shards is not None:
            yield from self._shard_samples()
            return
        if self.kind == ".parquet":
            yield from self._parquet_rows()
            return
        with self._open() as f:
            for number, raw in enumerate(f, start=1):
                if wanted(number - 1):
                    yield self._parse_line(raw, number)
                else:
                    yield None

    def _parse_line(self, raw: bytes, number: int) -> str:
        line = raw.removesuffix(b"\n").removesuffix(b"\r")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{self.url}, line {number}: invalid UTF-8 at byte {error.start} "
                f"({line[max(0, error.start - 10) : error.start + 10]!r}); re-encode the file "
                "as UTF-8."
            ) from None
        if self.kind == ".txt":
            return text
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{self.url}, line {number}: not JSON ({error.msg}); each line of a .jsonl "
                "file must be one JSON object."
            ) from None
        if not isinstance(record, dict) or self.text_field not in record:
            keys = type(record).__name__
            if isinstance(record, dict):
                keys = sorted(record)
            raise ValueError(
                f"{self.url}, line {number}: no field {self.text_field!r} (found {keys}); "
                "pass text_field= with the right name."
            )
        value = record[self.text_field]
        if not isinstance(value, str):
            raise ValueError(
                f"{self.url}, line {number}: field {self.text_field!r} is "
                f"{type(value).__name__}, not a string."
            )
        return value

    def _parquet_rows(self) -> Iterator[str]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(
                'Parquet texts need pyarrow: pip install "loader-recipes[parquet]" (or pyarrow).'
            ) from None
        with self._open() as raw:
            try:
                file = pq.ParquetFile(raw)
            except Exception as error:  # pyarrow.ArrowInvalid and friends
                raise ValueError(f"{self.url} is not a Parquet file ({error}).") from None
            if self.text_field not in file.schema_arrow.names:
                raise ValueError(
                    f"{self.url}: no column {self.text_field!r} (its columns: "
                    f"{file.schema_arrow.names}); pass text_field= with the right name."
                )
            row = 0
            for group in range(file.num_row_groups):
                for text in (
                    file.read_row_group(group, columns=[self.text_field]).column(0).to_pylist()
                ):
                    yield self._checked(text, f"row {row}")
                    row += 1

    def _shard_samples(self) -> Iterator[str]:
        columns = None
        if self.shards.format == "parquet":  # read only the text's column
            columns = [self.text_field]
        for shard, url in enumerate(self.shards.urls):
            for sample in read_checked(self.shards, shard, columns=columns):
                where = f"shard {url.rsplit('/', 1)[-1]}, sample {sample.get('__key__')!r}"
                if self.text_field not in sample:
                    raise ValueError(
                        f"{self.url}, {where}: no field {self.text_field!r} (found "
                        f"{sorted(k for k in sample if k != '__key__')}); pass text_field= with "
                        "the right name."
                    )
                yield self._checked(sample[self.text_field], where)

    def _checked(self, value, where: str) -> str:
        if not isinstance(value, str):
            raise ValueError(
                f"{self.describe()}, {where}: field {self.text_field!r} is {type(value).__name__}, "
                "not a string."
            )
        return value

    def _open(self):
        import fsspec

        return fsspec.open(self.url, "rb", compression="infer").open()


def _source(path: str, text_field: str, sets: dict) -> TextSource:
    """A file's source: a shard listed by its set's index is read through the set (every sample
    checked against the index), never as a plain Parquet file."""
    return TextSource(listed_shard(path, sets) or path, text_field=text_field)


def _is_hf_dataset(texts) -> bool:
    """A Hugging Face `datasets.Dataset` (not a dependency: recognised by its module and
    columns)."""
    return type(texts).__module__.startswith("datasets.") and hasattr(texts, "column_names")


def _refuse_paths(texts: Sequence) -> None:
    """A list of strings that all name existing paths is files passed by mistake: tokenizing it
    would cache the paths themselves (issue 27). Stops at the first string that is not a path."""
    if not len(texts) or not all(isinstance(t, str) and os.path.exists(t) for t in texts):
        return
    shown = ", ".join(repr(t) for t in list(texts[:2]))
    more = ", ..." if len(texts) > 2 else ""
    raise ValueError(
        f"`texts` is {len(texts)} strings that are all existing paths ({shown}{more}): a list of "
        "strings is tokenized as texts, so this would tokenize the paths. To read the files, pass "
        "them as `pathlib.Path`s ([Path(p) for p in paths]), their folder, or a glob such as "
        "'data/*.parquet'; pass shards as ShardSet.open(url) or their folder."
    )


def _known(url: str) -> bool:
    try:
        _kind(url)
    except ValueError:
        return False
    return True


def _kind(url: str) -> str:
    name = url.split("?")[0].lower()
    for compression in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(compression):
            name = name[: -len(compression)]
    for kind in _KINDS:
        if name.endswith(kind):
            return kind
    raise ValueError(
        f"{url}: unknown text file type; use .txt (one sample per line), .jsonl (one JSON object "
        "per line) or .parquet (`text_field` column), a folder or glob of them, a shard set's "
        "folder, or a list of strings."
    )
