"""Our shards feed our caches (issue 27): a `ShardSet`, its folder, a folder, a glob or a list of
`Path`s of text files into `build_token_cache`, each checked against the tokenizer run directly
on the original texts; a list of strings that are all paths is refused, never tokenized."""

import json
from pathlib import Path

import pytest

from recipes.common.shards.shard_set import ShardFormatError, ShardIndexError, ShardSet
from recipes.common.shards.shard_writer import write_shards
from recipes.nlp import build_token_cache
from recipes.testing_servers import LocalHTTPServer


def _direct(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


def _ids(cache):
    return [cache[i]["input_ids"].tolist() for i in range(len(cache))]


@pytest.fixture
def parquet_shards(corpus, tmp_path):
    pytest.importorskip("pyarrow")
    return write_shards(
        ({"__key__": f"k{i}", "text": t} for i, t in enumerate(corpus)),
        tmp_path / "pq",
        format="parquet",
        shard_bytes=4000,
        progress=False,
        shuffle=False,
    )


def test_a_parquet_shard_set_its_folder_and_a_glob_of_its_shards_are_the_texts(
    corpus, tokenizer, tmp_path, parquet_shards
):
    assert len(parquet_shards.entries) > 2  # several shards, read in order
    expected = _direct(tokenizer, corpus)
    sources = [
        parquet_shards,
        tmp_path / "pq",
        str(tmp_path / "pq") + "/",
        str(tmp_path / "pq" / "*.parquet"),
    ]
    for n, source in enumerate(sources):
        cache = build_token_cache(
            source, tokenizer, tmp_path / f"c{n}", progress=False, batch_size=64
        )
        assert _ids(cache) == expected, source
    assert cache.header["source"].endswith("*.parquet")


def test_a_tar_shard_set_reads_its_text_field(corpus, tokenizer, tmp_path):
    shards = write_shards(
        ({"__key__": f"k{i}", "txt": t, "cls": i} for i, t in enumerate(corpus)),
        tmp_path / "tar",
        shard_bytes=20_000,
        progress=False,
        shuffle=False,
    )
    assert len(shards.entries) > 1
    cache = build_token_cache(shards, tokenizer, tmp_path / "c", progress=False, text_field="txt")
    assert _ids(cache) == _direct(tokenizer, corpus)
    with pytest.raises(
        ValueError,
        match=r"sample 'k0': no field 'text' \(found \['cls', 'txt'\]\); pass text_field=",
    ):
        build_token_cache(shards, tokenizer, tmp_path / "d", progress=False)


def test_a_missing_parquet_column_is_named_before_any_read(tokenizer, tmp_path, parquet_shards):
    with pytest.raises(
        ValueError, match=r"no column 'body' \(their columns: \['__key__', 'text'\]\)"
    ):
        build_token_cache(
            parquet_shards, tokenizer, tmp_path / "c", progress=False, text_field="body"
        )


def test_remote_shards_are_keyed_on_the_index_and_checked_when_read(
    corpus, tokenizer, tmp_path, parquet_shards
):
    with LocalHTTPServer(tmp_path / "pq") as server:
        remote = ShardSet.open(server.url("").rstrip("/"))
        cache = build_token_cache(remote, tokenizer, tmp_path / "c", progress=False)
        assert _ids(cache) == _direct(tokenizer, corpus)
        stamp = (tmp_path / "c" / "tokens.bin").stat().st_mtime_ns
        # the same set, local: the same key (names and URLs are not in it), reused
        again = build_token_cache(parquet_shards, tokenizer, tmp_path / "c", progress=False)
        assert (
            tmp_path / "c" / "tokens.bin"
        ).stat().st_mtime_ns == stamp and again.fingerprint == cache.fingerprint
        shard = tmp_path / "pq" / parquet_shards.entries[1]["name"]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, other bytes, index unchanged
        shard.write_bytes(bytes(data))
        with pytest.raises(ShardFormatError, match="does not match its index"):
            build_token_cache(remote, tokenizer, tmp_path / "r", progress=False)
    with pytest.raises(ShardFormatError, match="does not match its index"):
        build_token_cache(tmp_path / "pq", tokenizer, tmp_path / "l", progress=False)


def test_a_changed_index_rebuilds(corpus, tokenizer, tmp_path, parquet_shards):
    first = build_token_cache(tmp_path / "pq", tokenizer, tmp_path / "c", progress=False)
    write_shards(
        ({"__key__": f"k{i}", "text": t} for i, t in enumerate(corpus[::-1])),
        tmp_path / "pq",
        format="parquet",
        shard_bytes=4000,
        progress=False,
        shuffle=False,
    )
    second = build_token_cache(tmp_path / "pq", tokenizer, tmp_path / "c", progress=False)
    assert second.fingerprint != first.fingerprint and _ids(second) == _direct(
        tokenizer, corpus[::-1]
    )


def test_shards_without_their_index_are_refused(tokenizer, tmp_path, parquet_shards):
    (tmp_path / "pq" / "index.json").unlink()
    with pytest.raises(ValueError, match="holds shards but no index.json"):
        build_token_cache(tmp_path / "pq", tokenizer, tmp_path / "c", progress=False)
    with pytest.raises(ShardIndexError):
        ShardSet.open(tmp_path / "pq")


def test_a_folder_a_glob_and_a_list_of_paths_of_text_files(corpus, tokenizer, tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [t for t in corpus if "\n" not in t]
    parts = [texts[:100], texts[100:200], texts[200:]]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("\n".join(parts[0]) + "\n", encoding="utf-8")
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in parts[1]))
    pq.write_table(pa.table({"text": parts[2]}), folder / "c.parquet", row_group_size=17)
    (folder / "README.md").write_text("not a corpus")
    (folder / "_SUCCESS").write_text("")
    expected = _direct(tokenizer, texts)
    paths = [folder / "a.txt", folder / "b.jsonl", folder / "c.parquet"]
    for n, source in enumerate([folder, str(folder / "*.*"), paths]):
        cache = build_token_cache(
            source, tokenizer, tmp_path / f"c{n}", progress=False, batch_size=32
        )
        assert _ids(cache) == expected, source
    reordered = build_token_cache(paths[::-1], tokenizer, tmp_path / "r", progress=False)
    assert _ids(reordered) == _direct(tokenizer, parts[2] + parts[1] + parts[0])
    assert reordered.fingerprint != cache.fingerprint


def test_a_folder_or_glob_without_text_files_says_so(tokenizer, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.csv").write_text("a,b\n")
    with pytest.raises(
        ValueError, match=r"no \.txt, \.jsonl or \.parquet files in it \(1 other entries\)"
    ):
        build_token_cache(tmp_path / "empty", tokenizer, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="no .txt, .jsonl or .parquet files match"):
        build_token_cache(str(tmp_path / "*.jsonl"), tokenizer, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="unknown text file type"):
        build_token_cache(tmp_path / "missing-folder", tokenizer, tmp_path / "c", progress=False)


def test_a_list_of_existing_paths_as_strings_is_refused_never_tokenized(
    tokenizer, tmp_path, parquet_shards
):
    paths = [str(tmp_path / "pq" / e["name"]) for e in parquet_shards.entries]
    for texts in (paths, paths[:1], [str(tmp_path / "pq")]):
        with pytest.raises(ValueError, match=r"all existing paths .*pass them as `pathlib.Path`s"):
            build_token_cache(texts, tokenizer, tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()
    # the hint works: the same files as Paths are the shards' texts
    cache = build_token_cache([Path(p) for p in paths], tokenizer, tmp_path / "c", progress=False)
    assert len(cache) == len(parquet_shards)


def test_strings_that_are_not_all_paths_stay_texts(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("x\n")
    texts = [str(tmp_path / "a.txt"), "the cat sat on the mat"]
    cache = build_token_cache(texts, tokenizer, tmp_path / "c", progress=False)
    assert _ids(cache) == _direct(tokenizer, texts)


def test_cli_takes_a_shard_folder(corpus, tokenizer, tmp_path, parquet_shards):
    from recipes.cli import main

    tokenizer.save_pretrained(tmp_path / "tok")
    assert (
        main(["cache", "nlp", str(tmp_path / "pq"), str(tmp_path / "tok"), str(tmp_path / "c")])
        == 0
    )
    stamp = (tmp_path / "c" / "tokens.bin").stat().st_mtime_ns
    cache = build_token_cache(
        parquet_shards, tokenizer, tmp_path / "c", progress=False
    )  # the same key: reused
    assert (tmp_path / "c" / "tokens.bin").stat().st_mtime_ns == stamp and _ids(cache) == _direct(
        tokenizer, corpus
    )


def _replace_shard(folder, name):
    """A shard swapped for another valid Parquet file: a plain read would tokenize its texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"__key__": ["x"], "text": ["not the shard's text"]}), folder / name)


def test_shard_files_named_alone_are_read_through_their_index(
    corpus, tokenizer, tmp_path, parquet_shards
):
    # review B4: a glob, a list of `Path`s or one path of shards is read through the set, every
    # sample checked
    name = parquet_shards.entries[1]["name"]
    paths = [tmp_path / "pq" / e["name"] for e in parquet_shards.entries]
    cache = build_token_cache(paths[1], tokenizer, tmp_path / "one", progress=False)
    first, second = (int(n) for n in parquet_shards.lengths[:2])
    assert _ids(cache) == _direct(
        tokenizer, corpus[first : first + second]
    )  # the shard's texts, checked
    _replace_shard(tmp_path / "pq", name)
    sources = [str(tmp_path / "pq" / "*.parquet"), paths, paths[1], str(paths[1])]
    for n, source in enumerate(sources):
        with pytest.raises(ShardFormatError, match=rf"{name} is \d[\d,]* bytes but its index says"):
            build_token_cache(source, tokenizer, tmp_path / f"c{n}", progress=False)


def test_tar_shard_files_named_alone_are_read_through_their_index(corpus, tokenizer, tmp_path):
    shards = write_shards(
        ({"__key__": f"k{i}", "txt": t} for i, t in enumerate(corpus)),
        tmp_path / "tar",
        shard_bytes=20_000,
        progress=False,
        shuffle=False,
    )
    paths = [tmp_path / "tar" / e["name"] for e in shards.entries]
    for n, source in enumerate([str(tmp_path / "tar" / "*.tar"), paths]):
        cache = build_token_cache(
            source, tokenizer, tmp_path / f"c{n}", progress=False, text_field="txt"
        )
        assert _ids(cache) == _direct(tokenizer, corpus)


def test_a_damaged_index_beside_shard_files_is_refused(tokenizer, tmp_path, parquet_shards):
    (tmp_path / "pq" / "index.json").write_text("{not json")
    with pytest.raises(ShardIndexError, match="damaged"):
        build_token_cache(
            str(tmp_path / "pq" / "*.parquet"), tokenizer, tmp_path / "c", progress=False
        )
