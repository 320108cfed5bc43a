"""A shard sample's fields as stored bytes and back: WebDataset's convention, with one rule for
what may be stored so that what is read back is what was written.

Use when: encoding samples for `recipes.common.shards.shard_formats` (tar members, Parquet columns)
or decoding what a shard holds (`decode_sample`). A sample is a dict with `"__key__"` and one entry
per field, keyed by extension. A field's value is stored as bytes: `bytes` as they are, `str` as
UTF-8, `int` as ASCII decimal (WebDataset's `.cls`), `dict`/`list` as JSON, a numpy array as `.npy`
(no pickle). `decode_sample` turns them back by extension (the part of the field name after its last
"."), as WebDataset's basic decoders do, in both formats: `meta.json` is JSON and `label.cls` an int
like `json` and `cls`. The rule: a value other than bytes goes under a field whose extension decodes
it back (an int under `INT_FIELDS`, a str under `TEXT_FIELDS`, a dict/list under `JSON_FIELDS`, an
array under `npy`), else it is refused: it would come back as its bytes. Text or bytes under those
fields must decode as the extension says (UTF-8; an int of 64 bits; JSON). Names `__x__` other than
`__key__` are refused (readers drop or fill them); an int must fit 64 bits (Parquet's int64). JSON
is standard JSON: int keys come back as strings and tuples as lists; keys of mixed types, numpy
scalars and other objects are refused (convert with `.item()`, `.tolist()`).
Cost: one encode per field; `decode_sample` one decode per field it knows.
Adapt here: `INT_FIELDS`, `TEXT_FIELDS`, `JSON_FIELDS` (what `decode_sample` decodes).
Trade-off: a key's basename may not contain "." (WebDataset splits the key from the extension
at the first dot). A Parquet column keeps its type: an int or str column comes back as it is
(a str is decoded only under a JSON field), so others' string `id` or `label` columns read.
Copy with: nothing.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np

INT_FIELDS = ("cls", "cls2", "index", "id", "label")
TEXT_FIELDS = ("txt", "text", "caption")
JSON_FIELDS = ("json",)
DECODED = (*INT_FIELDS, *TEXT_FIELDS, *JSON_FIELDS)  # text or bytes under these decode to a value


class ShardFormatError(ValueError):
    """A sample that cannot be stored, or a shard that does not read as its format."""


def sample_key(sample: Any, position: int) -> str:
    """The sample's `"__key__"`, checked.

    Raises:
        ShardFormatError: not a dict, no key, or a key WebDataset would split differently.
    """
    if not isinstance(sample, dict):
        raise ShardFormatError(
            f"sample {position} is a {type(sample).__name__}; write_shards takes dicts with "
            "'__key__' and one entry per field (WebDataset's convention: {'__key__': 'a', "
            "'jpg': b'...', 'cls': 3})."
        )
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ShardFormatError(
            f"sample {position} has no '__key__' (a non-empty str); got {key!r}."
        )
    if "." in os.path.basename(key) or key.endswith("/"):
        raise ShardFormatError(
            f"sample {position}: key {key!r} has a '.' in its last path part; WebDataset "
            "readers split the key from the field at the first dot. Replace the dots."
        )
    if key.startswith("/") or "//" in key:
        raise ShardFormatError(
            f"sample {position}: key {key!r} starts with '/' or holds '//'; a tar member name "
            "is a relative path, and readers would return another key. Use a relative key."
        )
    return key


def field_bytes(value: Any, key: str, field: str) -> bytes:
    """A field's value as stored: bytes, UTF-8 text, ASCII int, JSON or `.npy`.

    Raises:
        ShardFormatError: a value of another type, naming the key and the field.
    """
    if (
        isinstance(value, (bytes, bytearray, memoryview, str))
        and field.rsplit(".", 1)[-1] in DECODED
    ):
        return text_bytes(value, key, field)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (bool, np.bool_)):
        raise ShardFormatError(
            f"sample {key!r}, field {field!r}: a bool is ambiguous in a shard; store an int."
        )
    check_codec(value, key, field)
    if isinstance(value, (int, np.integer)):
        return str(fits_64_bits(int(value), key, field)).encode("ascii")
    if isinstance(value, (dict, list)):
        return json_text(value, key, field).encode("utf-8")
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise ShardFormatError(
                f"sample {key!r}, field {field!r}: an object array needs pickle; store numbers."
            )
        out = io.BytesIO()
        np.save(out, value, allow_pickle=False)
        return out.getvalue()
    raise ShardFormatError(
        f"sample {key!r}, field {field!r}: cannot store a {type(value).__name__}; give bytes, "
        "str, int, a dict/list (JSON) or a numpy array."
    )


def _decoded_as(ext: str) -> str:
    """What readers decode a field of extension `ext` as."""
    if ext in INT_FIELDS:
        return "an integer"
    if ext in JSON_FIELDS:
        return "JSON"
    return "UTF-8 text"


def text_bytes(value: str | bytes | bytearray | memoryview, key: str, field: str) -> bytes:
    """Text or bytes under a field of `DECODED`, as stored, checked the way `decode_sample` will
    decode it: refused now, naming the sample, not at read time.

    Raises:
        ShardFormatError: text UTF-8 cannot store, or not what the extension says (UTF-8 text,
            an int of 64 bits, JSON).
    """
    ext = field.rsplit(".", 1)[-1]
    if isinstance(value, str):
        data = utf8(value, key, field)
    else:
        data = bytes(value)
    number = None
    try:
        text = data.decode("utf-8")
        if ext in INT_FIELDS:
            number = int(text)
        if ext in JSON_FIELDS:
            json.loads(text)
    except (ValueError, RecursionError):
        kind = _decoded_as(ext)
        raise ShardFormatError(
            f"sample {key!r}, field {field!r}: {value[:40]!r} is not {kind}, which readers "
            f"decode a '.{ext}' field as; store it under another extension."
        ) from None
    if number is not None:
        fits_64_bits(number, key, field)
    return data


def utf8(text: str, key: str, field: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ShardFormatError(
            f"sample {key!r}, field {field!r}: the text holds {text[error.start : error.end]!r} at "
            f"position {error.start}, a lone surrogate that UTF-8 cannot store (text decoded with "
            "errors='surrogateescape'?); fix the text, or store bytes under another extension."
        ) from None


def fits_64_bits(number: int, key: str, field: str) -> int:
    if not -(2**63) <= number < 2**63:
        raise ShardFormatError(
            f"sample {key!r}, field {field!r}: {number} does not fit a 64-bit integer (Parquet "
            "refuses it too); store it under a text field ('txt'), or as bytes under another "
            "extension."
        )
    return number


def json_text(value: Any, key: str, field: str) -> str:
    """`value` as JSON text with sorted keys (the same bytes on every machine).

    Raises:
        ShardFormatError: a value that is not JSON, naming the key and the field.
    """
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as error:
        raise ShardFormatError(
            f"sample {key!r}, field {field!r}: the value is not JSON ({type(error).__name__}: "
            f"{str(error)[:100]}). Give dicts with str keys (int keys alone are turned into "
            "strings; mixed key types cannot be sorted) and lists of str, int, float, bool or "
            "None: convert numpy values with .item() or .tolist()."
        ) from None


_CODECS = (
    (str, TEXT_FIELDS, "str"),
    (int, INT_FIELDS, "int"),
    (np.integer, INT_FIELDS, "int"),
    (dict, JSON_FIELDS, "dict"),
    (list, JSON_FIELDS, "list"),
    (np.ndarray, ("npy",), "numpy array"),
)


def check_codec(value: Any, key: str, field: str) -> None:
    """A value other than bytes must be under a field that readers decode back to its type
    (`decode_sample`: ints, text, JSON and `.npy` by extension); anywhere else it would come back
    as its encoded bytes."""
    ext = field.rsplit(".", 1)[-1]
    for kind, exts, name in _CODECS:
        if isinstance(value, kind) and ext not in exts:
            raise ShardFormatError(
                f"sample {key!r}, field {field!r}: a {name} under a field that readers return as "
                f"bytes (a {name} is decoded back only under {', '.join(repr(e) for e in exts)}); "
                "rename the field, or encode the value to bytes yourself."
            )


def sample_fields(sample: dict, key: str) -> list[tuple[str, bytes]]:
    """`(field, stored bytes)` of every field but the key, in the sample's order.

    Raises:
        ShardFormatError: no fields, a field name that is not an extension, or a bad value.
    """
    fields = []
    for field, value in sample.items():
        if not isinstance(field, str):
            raise ShardFormatError(
                f"sample {key!r}: field {field!r} is a {type(field).__name__}; field names are "
                "extensions such as 'jpg' or 'cls'."
            )
        if field == "__key__":
            continue
        check_field_name(field, key)
        if not field or "/" in field or field.startswith("."):
            raise ShardFormatError(
                f"sample {key!r}: field {field!r} is not an extension such as 'jpg' or 'cls'."
            )
        fields.append((field, field_bytes(value, key, field)))
    if not fields:
        raise ShardFormatError(f"sample {key!r} has no fields besides '__key__'.")
    return fields


def check_field_name(field: str, key: str) -> None:
    if field.startswith("__") and field.endswith("__"):
        raise ShardFormatError(
            f"sample {key!r}: field {field!r} is a reserved name (WebDataset's '__url__', ...: "
            "readers drop them, or fill them in); '__key__' is the only one stored. Rename it."
        )


def decode_sample(sample: dict, source: str = "a shard") -> dict:
    """Stored field bytes back to values by extension (the part after the last "."): ints, text,
    JSON, `.npy` arrays; other fields (images, audio) stay bytes for the domain decoders. A str
    (a Parquet string column) is decoded only under a JSON field; other values stay as they are.

    Raises:
        ShardFormatError: a value that does not decode as its extension says, naming `source`
            (the shard), the sample's key and the field.
    """
    out = {}
    for field, value in sample.items():
        ext = field.rsplit(".", 1)[-1]
        try:
            if field.startswith("__") or not (
                isinstance(value, (bytes, bytearray))
                or (isinstance(value, str) and ext in JSON_FIELDS)
            ):
                out[field] = value
            elif ext in INT_FIELDS:
                out[field] = int(value)
            elif ext in TEXT_FIELDS:
                out[field] = bytes(value).decode("utf-8")
            elif ext in JSON_FIELDS:
                out[field] = json.loads(value)
            elif ext == "npy":
                out[field] = np.load(io.BytesIO(value), allow_pickle=False)
            else:
                out[field] = bytes(value)
        except (
            ValueError,
            EOFError,
            OSError,
            RecursionError,
        ) as error:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
            raise ShardFormatError(
                f"{source}: sample {sample.get('__key__')!r}, field {field!r} does not decode as "
                f"'.{ext}' ({type(error).__name__}: {str(error)[:200]}); read it with "
                "decode=False, or fix the shard."
            ) from None
    return out
