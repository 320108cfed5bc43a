"""One rule for a sample's fields in both formats (tar and Parquet): what a field decodes to is
set by its extension, the part after the last "." (`meta.json` is JSON, `label.cls` an int), and
whatever readers would not give back is refused at write, naming the sample and the field."""

import numpy as np
import pytest

from recipes.common.shards.shard_set import ShardFormatError, ShardSet
from recipes.common.shards.shard_writer import write_shards

pytest.importorskip("pyarrow")
FORMATS = ["tar", "parquet"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fields_decode_by_their_extension_in_both_formats(tmp_path, fmt):
    samples = [
        {
            "__key__": f"k{i}",
            "meta.json": {"x": i, "tags": ["a"]},
            "label.cls": i,
            "caption.txt": f"a cat {i}",
            "json": {"1": i},
        }
        for i in range(5)
    ]
    shards = write_shards(samples, tmp_path / "s", format=fmt, progress=False, shuffle=False)
    assert list(ShardSet.open(tmp_path / "s").read(0)) == samples
    assert [s["meta.json"] for s in shards.dataset(shuffle=False)] == [
        s["meta.json"] for s in samples
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_json_is_standard_json(tmp_path, fmt):
    # int keys come back as strings and tuples as lists (documented in
    # recipes.common.shards.shard_samples)
    write_shards(
        [{"__key__": "k", "json": {1: "a", 2: (1, 2)}}],
        tmp_path / "s",
        format=fmt,
        progress=False,
        shuffle=False,
    )
    assert next(iter(ShardSet.open(tmp_path / "s").read(0)))["json"] == {"1": "a", "2": [1, 2]}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "json",
            {1: "a", "b": 2},
            r"the value is not JSON \(TypeError: .*\)\. Give dicts with str keys",
        ),
        ("json", [np.int64(3)], r"the value is not JSON \(TypeError: .*int64.*\)\. .*\.item\(\)"),
        ("meta.json", {"a": np.float32(1)}, r"the value is not JSON"),
        (
            "txt",
            "a\udc80",
            r"the text holds '\\udc80' at position 1, a lone surrogate that UTF-8 cannot store",
        ),
        ("cls", "9" * 30, r"9{30} does not fit a 64-bit integer"),
        ("cls", b"9" * 30, r"9{30} does not fit a 64-bit integer"),
        ("label.cls", "-" + "9" * 30, r"-9{30} does not fit a 64-bit integer"),
        ("meta.json", "{not", r"'\{not' is not JSON, which readers decode a '\.json' field as"),
        ("label.cls", "x", r"'x' is not an integer"),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_values_that_would_not_read_back_are_refused_naming_key_and_field(
    tmp_path, fmt, field, value, message
):
    with pytest.raises(ShardFormatError, match=rf"sample 'k', field '{field}': {message}"):
        write_shards(
            [{"__key__": "k", field: value}],
            tmp_path / "s",
            format=fmt,
            progress=False,
            shuffle=False,
        )


def test_a_surrogate_in_any_parquet_string_column_is_named(tmp_path):
    with pytest.raises(
        ShardFormatError, match=r"sample 'k', field 'name': the text holds '\\udc80'"
    ):
        write_shards(
            [{"__key__": "k", "name": "a\udc80"}],
            tmp_path / "s",
            format="parquet",
            progress=False,
            shuffle=False,
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_write_gives_one_empty_shard_in_both_formats(tmp_path, fmt):
    shards = write_shards([], tmp_path / "s", format=fmt, progress=False, shuffle=False)
    reopened = ShardSet.open(tmp_path / "s")
    assert len(shards) == len(reopened) == 0 and len(reopened.entries) == 1
    assert list(reopened.read(0)) == [] and list(reopened.dataset(shuffle=False)) == []
