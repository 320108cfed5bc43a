"""write_shards / ShardSet / read_tar / read_parquet / index_shards (issue 22): round trips that
compare bytes with the samples written, WebDataset and pyarrow as independent readers and
writers, typed errors naming the sample key, and a writer SIGKILLed mid-shard."""

import hashlib
import io
import json
import os
import signal
import time
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.common.shards.shard_formats import (
    ShardFormatError,
    decode_sample,
    read_parquet,
    read_tar,
)
from recipes.common.shards.shard_set import ShardIndexError, ShardSet
from recipes.common.shards.shard_writer import index_shards, write_shards
from recipes.testing_servers import LocalHTTPServer

pa = pytest.importorskip("pyarrow")
wds = pytest.importorskip("webdataset")


def _samples(n=120, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "__key__": f"dir{i % 3}/s{i:04d}",
            "jpg": rng.bytes(int(rng.integers(10, 3000))),
            "cls": i % 7,
            "txt": f"caption {i} é",
            "json": {"i": i, "tags": ["a", "b"][: i % 3]},
        }
        for i in range(n)
    ]


def _same(read, written):
    assert [s["__key__"] for s in read] == [s["__key__"] for s in written]
    for r, w in zip(read, written, strict=True):
        assert (
            r["jpg"] == w["jpg"]
            and r["cls"] == w["cls"]
            and r["txt"] == w["txt"]
            and r["json"] == w["json"]
        )


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_round_trip_by_shard_and_by_range(tmp_path, fmt):
    samples = _samples()
    shards = write_shards(
        samples, tmp_path / "set", format=fmt, shard_bytes=40_000, progress=False, shuffle=False
    )
    assert len(shards.entries) >= 4 and len(shards) == len(samples)
    assert shards.lengths.sum() == len(samples)
    _same([s for i in range(len(shards.entries)) for s in shards.read(i)], samples)
    start = 0
    for i, entry in enumerate(shards.entries):
        data = (tmp_path / "set" / entry["name"]).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
        n = entry["samples"]
        mine = samples[start : start + n]
        for lo, hi in [(0, None), (1, 3), (n - 1, n), (n - 2, None), (2, 2), (n, None)]:
            _same(list(shards.read(i, lo, hi)), mine[lo:hi])
        start += n
    if fmt == "tar":  # no index: a scan of the headers
        _same(
            [decode_sample(s) for s in read_tar(shards.urls[1], 2, 4)],
            samples[shards.lengths[0] + 2 : shards.lengths[0] + 4],
        )
    else:
        assert [r["cls"] for r in read_parquet(shards.urls[0], 1, 3, columns=["cls"])] == [1, 2]


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_the_dataset_reads_each_sample_once_over_workers_and_epochs(tmp_path, fmt):
    samples = _samples(90)
    shards = write_shards(
        samples, tmp_path / "set", format=fmt, shard_bytes=30_000, progress=False, shuffle=False
    )
    ds = shards.dataset(shuffle=True, seed=4)
    by_key = {s["__key__"]: s for s in samples}
    for epoch in range(2):
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        seen = Counter()
        for sample in loader:
            seen[sample["__key__"]] += 1
            assert (
                sample["jpg"] == by_key[sample["__key__"]]["jpg"]
                and sample["cls"] == by_key[sample["__key__"]]["cls"]
            )
        assert seen == Counter(by_key.keys()), epoch
    few = write_shards(
        samples, tmp_path / f"few{fmt}", format=fmt, progress=False, shuffle=False
    )  # one shard, 2 ranks
    assert len(few.entries) == 1
    counts = [
        Counter(s["__key__"] for s in few.dataset(rank=r, world_size=2, even=False))
        for r in range(2)
    ]
    assert (
        sum(counts, Counter()) == Counter(by_key.keys())
        and abs(sum(counts[0].values()) - sum(counts[1].values())) <= 1
    )


def test_webdataset_reads_our_tars_and_we_read_and_index_its_tars(tmp_path):
    samples = _samples(60)
    ours = write_shards(
        samples, tmp_path / "ours", shard_bytes=25_000, progress=False, shuffle=False
    )
    theirs = list(wds.WebDataset(ours.urls, shardshuffle=False))
    assert [s["__key__"] for s in theirs] == [s["__key__"] for s in samples]
    assert all(
        t["jpg"] == s["jpg"]
        and t["cls"] == str(s["cls"]).encode()
        and t["txt"] == s["txt"].encode()
        and json.loads(t["json"]) == s["json"]
        for t, s in zip(theirs, samples, strict=True)
    )
    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "x-%04d.tar"), maxcount=17, verbose=0) as sink:
        for s in samples:
            sink.write(
                {"__key__": s["__key__"], "jpg": s["jpg"], "cls": s["cls"], "json": s["json"]}
            )
    names = sorted(str(p) for p in (tmp_path / "wds").glob("*.tar"))
    assert [s["__key__"] for n in names for s in read_tar(n)] == [s["__key__"] for s in samples]
    indexed = index_shards(names, progress=False)
    assert indexed.lengths.tolist() == [17, 17, 17, 9]
    read = [s for i in range(4) for s in indexed.read(i)]
    assert [(s["__key__"], s["jpg"], s["cls"], s["json"]) for s in read] == [
        (s["__key__"], s["jpg"], s["cls"], s["json"]) for s in samples
    ]
    assert [s["__key__"] for s in indexed.read(2, 5, 8)] == [s["__key__"] for s in samples[39:42]]


def test_pyarrow_reads_our_parquet(tmp_path):
    import pyarrow.parquet as pq

    samples = _samples(50)
    shards = write_shards(samples, tmp_path / "p", format="parquet", progress=False, shuffle=False)
    table = pq.read_table(shards.urls[0])
    assert table.column_names == ["__key__", "jpg", "cls", "txt", "json"]
    assert table.column("jpg").to_pylist() == [s["jpg"] for s in samples]
    assert table.column("cls").to_pylist() == [s["cls"] for s in samples]
    assert [json.loads(v) for v in table.column("json").to_pylist()] == [s["json"] for s in samples]


def test_numpy_fields_round_trip_without_pickle(tmp_path):
    arrays = [np.arange(i * 6, dtype=np.float32).reshape(i, 6) for i in range(1, 5)]
    shards = write_shards(
        ({"__key__": f"a{i}", "npy": a} for i, a in enumerate(arrays)),
        tmp_path / "n",
        progress=False,
        shuffle=False,
    )
    read = list(shards.read(0))
    assert all(
        np.array_equal(r["npy"], a) and r["npy"].dtype == a.dtype
        for r, a in zip(read, arrays, strict=True)
    )
    with pytest.raises(ShardFormatError, match="object array"):
        write_shards(
            [{"__key__": "o", "npy": np.array([{}], dtype=object)}],
            tmp_path / "o",
            progress=False,
            shuffle=False,
        )


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"jpg": b"x"}, r"sample 1 has no '__key__'"),
        ({"__key__": "a.b", "jpg": b"x"}, r"key 'a.b' has a '\.'"),
        ({"__key__": "k", "cls": True}, r"sample 'k', field 'cls': a bool"),
        ({"__key__": "k", "cls": {1, 2}}, r"sample 'k', field 'cls': cannot store a set"),
        ({"__key__": "k"}, r"sample 'k' has no fields"),
        (["not", "a", "dict"], r"sample 1 is a list"),
        ({"__key__": "s0000", "jpg": b"x"}, r"key 's0000' appears twice"),
    ],
)
def test_bad_samples_raise_naming_the_key(tmp_path, sample, message):
    with pytest.raises(ShardFormatError, match=message):
        write_shards(
            [{"__key__": "s0000", "jpg": b"ok"}, sample],
            tmp_path / "bad",
            progress=False,
            shuffle=False,
        )
    with pytest.raises(ShardIndexError, match="does not exist"):
        ShardSet.open(tmp_path / "bad")


def test_parquet_rows_must_keep_the_first_samples_columns(tmp_path):
    with pytest.raises(
        ShardFormatError, match=r"sample 'b' has fields \['txt'\], but the first sample set"
    ):
        write_shards(
            [{"__key__": "a", "jpg": b"1"}, {"__key__": "b", "txt": "x"}],
            tmp_path / "p",
            format="parquet",
            progress=False,
            shuffle=False,
        )


def test_a_damaged_index_or_shard_says_so(tmp_path):
    shards = write_shards(_samples(10), tmp_path / "s", progress=False, shuffle=False)
    (tmp_path / "s" / "index.json").write_text("{not json")
    with pytest.raises(ShardIndexError, match="damaged"):
        ShardSet.open(tmp_path / "s")
    (tmp_path / "junk.tar").write_bytes(b"hello" * 100)
    with pytest.raises(ShardFormatError, match="is not a tar"):
        list(read_tar(tmp_path / "junk.tar"))
    assert len(list(read_tar(shards.urls[0]))) == 10


KILL_WRITER = r"""
import os, sys, time
import recipes.common.shards.shard_writer as shards

out, pause_at = sys.argv[1], int(sys.argv[2])
real_replace = os.replace
def slow_replace(src, dst):
    # the second shard's bytes are in its temp file: wait to be killed
    if dst.endswith("shard-000001.tar"):
        print("writing", flush=True)
        time.sleep(60)
    real_replace(src, dst)
shards.os.replace = slow_replace
samples = ({"__key__": f"s{i:04d}", "bin": bytes([i % 256]) * 1000} for i in range(40))
shards.write_shards(samples, out, shard_bytes=10_000, progress=False, shuffle=False)
"""


def test_a_writer_killed_mid_shard_leaves_no_partial_shard_and_no_index(tmp_path, zygote):
    out = tmp_path / "set"
    proc = zygote.python(KILL_WRITER, str(out), "0")
    deadline = time.time() + 60
    while "writing" not in proc.stdout:
        assert time.time() < deadline and proc.poll() is None, proc.stderr
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    names = sorted(os.listdir(out))
    assert (
        names[0] == "shard-000000.tar" and len(names) == 2 and ".tmp-" in names[1]
    )  # the temp, never a shard
    published = (out / "shard-000000.tar").read_bytes()
    with pytest.raises(ShardIndexError, match="does not exist"):
        ShardSet.open(out)
    samples = [{"__key__": f"s{i:04d}", "bin": bytes([i % 256]) * 1000} for i in range(40)]
    shards = write_shards(
        samples, out, shard_bytes=10_000, progress=False, shuffle=False
    )  # the rerun completes
    assert not [n for n in os.listdir(out) if ".tmp-" in n]  # and sweeps the dead writer's temp
    assert [s["bin"] for i in range(len(shards.entries)) for s in shards.read(i)] == [
        s["bin"] for s in samples
    ]
    clean = write_shards(
        samples, tmp_path / "clean", shard_bytes=10_000, progress=False, shuffle=False
    )
    assert [(out / e["name"]).read_bytes() for e in shards.entries] == [
        (tmp_path / "clean" / e["name"]).read_bytes() for e in clean.entries
    ]
    assert published == (tmp_path / "clean" / "shard-000000.tar").read_bytes()  # it was whole


def test_images_and_audio_decode_from_shard_samples(tmp_path, image_tree_for_shards):
    """ShardImages gives ImageFolderFast's pixels (eval) for the same files; ShardAudio gives
    soundfile's samples; both name the key of a bad sample."""
    import soundfile as sf

    from recipes.audio.shard_audio import ShardAudio, ShardAudioError
    from recipes.commands.shards_cmd import image_folder_samples
    from recipes.vision import ImageDecodeError, ImageFolderFast
    from recipes.vision.shard_images import ShardImages

    root = image_tree_for_shards
    shards = write_shards(
        image_folder_samples(root), tmp_path / "img", progress=False, shuffle=False
    )
    folder = ImageFolderFast(root, size=64)
    items = list(shards.dataset(shuffle=False, transform=ShardImages(64)))
    assert len(items) == len(folder)
    for (image, label), i in zip(items, range(len(folder)), strict=True):
        expected, target = folder[i]
        assert torch.equal(image, expected) and label == target
    train = list(shards.dataset(shuffle=False, transform=ShardImages(32, train=True)))
    assert all(image.shape == (3, 32, 32) for image, _ in train)
    with pytest.raises(ImageDecodeError, match="sample 'k' has no image field"):
        ShardImages()({"__key__": "k", "txt": b"x"})
    with pytest.raises(ImageDecodeError, match="k.jpg"):
        ShardImages()({"__key__": "k", "jpg": b"<html>404</html>", "cls": 0})
    wave = (np.sin(np.arange(8000) / 5) * 0.5).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, wave, 8000, format="FLAC")
    decoded, info = ShardAudio()({"__key__": "u1", "flac": buffer.getvalue(), "txt": "hello"})
    assert decoded.shape == (1, 8000) and np.abs(decoded[0].numpy() - wave).max() < 1e-4
    assert info["key"] == "u1" and info["txt"] == "hello" and info["sample_rate"] == 8000
    assert ShardAudio(sample_rate=4000)({"__key__": "u1", "flac": buffer.getvalue()})[0].shape == (
        1,
        4000,
    )
    with pytest.raises(ShardAudioError, match="sample 'bad'"):
        ShardAudio()({"__key__": "bad", "flac": b"not audio"})


@pytest.fixture
def image_tree_for_shards(tmp_path):
    from recipes.testing import make_image_folder

    return make_image_folder(tmp_path / "tree", classes=2, per_class=4, size=(160, 120), seed=9)


# a long run (14 s): torchrun, 2 ranks x 2 workers over S3; the single-process splits run in the
# fast tier
@pytest.mark.slow
def test_two_ranks_write_the_same_bytes_and_read_every_sample_once_from_s3(tmp_path, monkeypatch):
    """torchrun, 2 ranks: shards split over the ranks are byte-identical to one process's, on
    disk and on S3 (moto through s3fs); read back through PrefetchCache by 2 ranks x 2 workers
    for 2 epochs, every sample comes once per epoch with its bytes and label, equal counts per rank.
    """
    import subprocess
    import sys
    from pathlib import Path

    import s3fs

    from recipes.commands.shards_cmd import image_folder_samples
    from recipes.testing import make_image_folder, make_text_corpus
    from recipes.testing_servers import MotoS3Server

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    make_image_folder(tmp_path / "tree", classes=3, per_class=6, size=(160, 120), seed=8)
    texts = make_text_corpus(97, median_words=12, seed=2)
    (tmp_path / "texts.txt").write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n")
    lines = (tmp_path / "texts.txt").read_text().splitlines()
    images = image_folder_samples(tmp_path / "tree")
    single = write_shards(
        images, tmp_path / "single_tar", shard_bytes=60_000, progress=False
    )  # shuffled, as the ranks
    single_text = write_shards(
        [{"__key__": f"t{i:05d}", "txt": t} for i, t in enumerate(lines)],
        tmp_path / "single_text",
        format="parquet",
        shard_bytes=3_000,
        progress=False,
    )
    assert len(single.entries) >= 4 and len(single_text.entries) >= 4
    script = Path(__file__).with_name("dist_shards_script.py")
    with MotoS3Server() as server:
        server.client().create_bucket(Bucket="bucket")
        endpoint = server.storage_options()["client_kwargs"]["endpoint_url"]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(script),
                str(tmp_path),
                endpoint,
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        fs = s3fs.S3FileSystem(**server.storage_options())
        for folder, prefix in (
            (tmp_path / "single_tar", "bucket/tar"),
            (tmp_path / "single_text", "bucket/text"),
        ):
            names = sorted(p.name for p in folder.iterdir())
            assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(prefix)) == names
            assert all(fs.cat(f"{prefix}/{n}") == (folder / n).read_bytes() for n in names), prefix
    for name in sorted(p.name for p in (tmp_path / "single_tar").iterdir()):
        assert (tmp_path / "split_tar" / name).read_bytes() == (
            tmp_path / "single_tar" / name
        ).read_bytes(), name
    reads = [json.loads((tmp_path / f"read-{r}.json").read_text()) for r in range(2)]
    expected_images = {
        s["__key__"]: [hashlib.sha256(s["jpg"]).hexdigest(), s["cls"]] for s in images
    }
    expected_texts = {f"t{i:05d}": t for i, t in enumerate(lines)}
    for epoch in range(2):
        per_rank = [[row for row in read["tar"] if row[0] == epoch] for read in reads]
        assert len(per_rank[0]) == len(per_rank[1])  # even: no rank waits at a collective
        counts = Counter(row[1] for rows in per_rank for row in rows)
        assert sum(counts.values()) >= len(images) and set(counts) == set(expected_images)
        assert (
            sum(counts.values()) - len(images) <= 1
        )  # at most world_size - 1 repeats, to even the ranks
        assert all(row[2:] == expected_images[row[1]] for rows in per_rank for row in rows)
        text_rows = [[row for row in read["parquet"] if row[0] == epoch] for read in reads]
        assert len(text_rows[0]) == len(text_rows[1])
        text_counts = Counter(row[1] for rows in text_rows for row in rows)
        assert (
            set(text_counts) == set(expected_texts) and sum(text_counts.values()) - len(lines) <= 1
        )
        assert all(row[2] == expected_texts[row[1]] for rows in text_rows for row in rows)


def test_long_keys_and_truncated_tars(tmp_path):
    """A key past ustar's 100 characters gets a PAX header (read by tarfile, and by webdataset);
    a tar cut short raises instead of yielding a partial sample."""
    samples = [{"__key__": "deep/" * 30 + f"s{i}", "bin": bytes([i]) * 700} for i in range(5)]
    shards = write_shards(samples, tmp_path / "long", progress=False, shuffle=False)
    assert [(s["__key__"], s["bin"]) for s in shards.read(0)] == [
        (s["__key__"], s["bin"]) for s in samples
    ]
    assert [s["__key__"] for s in shards.read(0, 2, 4)] == [s["__key__"] for s in samples[2:4]]
    assert [s["__key__"] for s in wds.WebDataset(shards.urls, shardshuffle=False)] == [
        s["__key__"] for s in samples
    ]
    plain = write_shards(
        [{"__key__": f"s{i}", "bin": bytes([i]) * 700} for i in range(5)],
        tmp_path / "p",
        progress=False,
        shuffle=False,
    )
    data = (tmp_path / "p" / "shard-000000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(
        data[: plain.entries[0]["offsets"][3] + 600]
    )  # inside sample 3's data
    with pytest.raises(ShardFormatError, match="cut.tar is not a tar file, or a damaged one"):
        list(read_tar(tmp_path / "cut.tar"))


def test_the_command_line_writes_and_indexes_shards(tmp_path, image_tree_for_shards, capsys):
    from recipes.cli import main
    from recipes.testing import make_audio_files

    assert (
        main(
            [
                "shards",
                "vision",
                str(image_tree_for_shards),
                str(tmp_path / "img"),
                "--shard-mb",
                "0.05",
            ]
        )
        == 0
    )
    images = ShardSet.open(tmp_path / "img")
    assert len(images) == 8 and len(images.entries) >= 2 and "8 samples" in capsys.readouterr().out
    written = [s for shard in range(len(images.entries)) for s in images.read(shard)]
    files = sorted(image_tree_for_shards.glob("*/*.jpg"))
    keys = [f"{f.parent.name}/{f.stem}" for f in files]
    assert sorted(s["__key__"] for s in written) == keys
    assert [s["__key__"] for s in written] != keys  # written in a random order by default
    for sample in written:  # each key still holds its own file and label
        path = image_tree_for_shards / f"{sample['__key__']}.jpg"
        assert sample["jpg"] == path.read_bytes() and sample["cls"] == int(
            path.parent.name.split("_")[1]
        )
    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(30))
    )
    assert (
        main(
            [
                "shards",
                "text",
                str(tmp_path / "c.jsonl"),
                str(tmp_path / "txt"),
                "--format",
                "parquet",
                "--text-field",
                "body",
                "--no-shuffle",
            ]
        )
        == 0
    )
    assert [s["txt"] for s in ShardSet.open(tmp_path / "txt").read(0)] == [
        f"text {i}" for i in range(30)
    ]
    make_audio_files(tmp_path / "audio", count=2, seconds=[0.5, 0.3], sample_rate=8000, seed=1)
    assert main(["shards", "audio", str(tmp_path / "audio"), str(tmp_path / "aud")]) == 0
    assert len(ShardSet.open(tmp_path / "aud")) == 2
    (tmp_path / "img" / "index.json").unlink()
    assert main(["shards", "index", *map(str, sorted((tmp_path / "img").glob("*.tar")))]) == 0
    assert ShardSet.open(tmp_path / "img").lengths.tolist() == images.lengths.tolist()
    assert main(["shards", "vision", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    assert "missing" in capsys.readouterr().err


def test_damaged_or_rewritten_shards_are_never_served(tmp_path):
    """A bit flip or a cut in a shard, read locally or through PrefetchCache, raises naming it;
    a cached copy of a shard since rewritten under the same URL is downloaded again."""
    from recipes.common import PrefetchCache

    samples = [{"__key__": f"k{i:04d}", "txt": f"text {i}", "cls": i} for i in range(60)]
    shards = write_shards(
        samples, tmp_path / "s", shard_bytes=20_000, progress=False, shuffle=False
    )
    path = tmp_path / "s" / shards.entries[0]["name"]
    data = bytearray(path.read_bytes())
    data[700] ^= 0x01  # inside sample 0's text
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="does not match its index"):
        list(shards.read(0))
    path.write_bytes(bytes(data[:4096]))
    with pytest.raises(ShardFormatError, match="bytes but its index says"):
        list(shards.dataset(shuffle=False))
    write_shards(
        samples, tmp_path / "s", shard_bytes=20_000, progress=False, shuffle=False
    )  # repaired
    with LocalHTTPServer(tmp_path / "s") as server:
        remote = ShardSet.open(server.url("").rstrip("/"))
        cache = PrefetchCache(tmp_path / "cache", max_bytes=2**30)
        assert [s["cls"] for s in remote.dataset(cache=cache, shuffle=False)] == list(range(60))
        rewritten = [{**s, "txt": s["txt"].upper()} for s in samples]  # same sizes, other bytes
        write_shards(rewritten, tmp_path / "s", shard_bytes=20_000, progress=False, shuffle=False)
        again = ShardSet.open(server.url("").rstrip("/"))
        assert [s["txt"] for s in again.dataset(cache=cache, shuffle=False)] == [
            s["txt"] for s in rewritten
        ]


def test_a_rewrite_removes_the_old_index_first_and_stale_shards_last(tmp_path):
    big = [{"__key__": f"a{i:04d}", "bin": bytes([i % 256]) * 900} for i in range(100)]
    write_shards(big, tmp_path / "s", shard_bytes=10_000, progress=False, shuffle=False)
    seen = []
    import recipes.common.shards.shard_writer as module

    real = module._Writer.write_shard

    def spy(self, number, pending):
        seen.append((tmp_path / "s" / "index.json").exists())  # while the new shards are written
        return real(self, number, pending)

    module._Writer.write_shard = spy
    try:
        small = write_shards(
            big[:20], tmp_path / "s", shard_bytes=10_000, progress=False, shuffle=False
        )
    finally:
        module._Writer.write_shard = real
    assert seen and not any(seen)
    assert sorted(p.name for p in (tmp_path / "s").glob("shard-*")) == [
        e["name"] for e in small.entries
    ]
    assert (
        len(index_shards(sorted(str(p) for p in (tmp_path / "s").glob("*.tar")), progress=False))
        == 20
    )


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"__key__": "/abs", "bin": b"x"}, r"starts with '/' or holds '//'"),
        ({"__key__": "a//b", "bin": b"x"}, r"starts with '/' or holds '//'"),
        ({"__key__": "k", 3: b"x"}, r"field 3 is a int"),
        ({"__key__": "k", "cls": b"abc"}, r"b'abc' is not an integer"),
        ({"__key__": "k", "json": "{not"}, r"is not JSON"),
        ({"__key__": "k", "txt": b"\xff\xfe"}, r"is not UTF-8 text"),
    ],
)
def test_more_bad_samples_raise_naming_the_key(tmp_path, sample, message):
    with pytest.raises(ShardFormatError, match=message):
        write_shards([sample], tmp_path / "bad", progress=False, shuffle=False)


def test_parquet_columns_keep_their_type(tmp_path):
    for later, message in (
        (2.5, "a float where the first sample set the column's type to int64"),
        ("x", "a str where"),
        (2**70, "does not fit a 64-bit integer"),
    ):
        with pytest.raises(ShardFormatError, match=rf"sample 'b', field 'v': .*{message}"):
            write_shards(
                [{"__key__": "a", "v": 1}, {"__key__": "b", "v": later}],
                tmp_path / "p",
                format="parquet",
                progress=False,
                shuffle=False,
            )


def test_indexing_refuses_tars_whose_samples_are_not_grouped(tmp_path):
    import tarfile

    with tarfile.open(tmp_path / "x.tar", "w") as tar:
        for name in ("a.txt", "b.txt", "a.cls", "b.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ShardFormatError, match="members of key 'a' are not adjacent"):
        index_shards([str(tmp_path / "x.tar")], progress=False)
    (tmp_path / "i.json").write_text(json.dumps({"format": "recipes-shards", "version": 1}))
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "index.json").write_text(
        json.dumps({"format": "recipes-shards", "version": 1})
    )
    with pytest.raises(ShardIndexError, match="incomplete"):
        ShardSet.open(tmp_path / "inc")


def test_the_converter_refuses_files_that_share_a_key(tmp_path):
    from recipes.commands.shards_cmd import image_folder_samples
    from recipes.testing import make_image_folder

    root = make_image_folder(tmp_path / "t", classes=1, per_class=2, size=(64, 48), seed=1)
    source = root / "class_00" / "img_0000.jpg"
    (root / "class_00" / "img.0000.jpg").write_bytes(
        source.read_bytes()
    )  # img_0000 after '.' -> '_'
    with pytest.raises(
        ValueError,
        match=r"img.0000.jpg and .*img_0000.jpg both become sample key|img_0000.jpg and "
        r".*img.0000.jpg both become",
    ):
        image_folder_samples(root)


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_a_resume_in_a_later_epoch_through_make_loader_and_the_cache(tmp_path, fmt):
    """make_loader's defaults (2 persistent workers here), PrefetchCache over HTTP, fewer shards
    than consumers for Parquet: a state saved mid-epoch 1 resumes exactly in a fresh loader."""
    from recipes.common import PrefetchCache, make_loader

    samples = [{"__key__": f"k{i:04d}", "txt": f"text {i}", "cls": i} for i in range(90)]
    write_shards(
        samples,
        tmp_path / "s",
        format=fmt,
        shard_bytes=8_000 if fmt == "tar" else 1 << 20,
        progress=False,
        shuffle=False,
    )
    with LocalHTTPServer(tmp_path / "s") as server:

        def build(name):
            shards = ShardSet.open(server.url("").rstrip("/"))
            ds = shards.dataset(cache=PrefetchCache(tmp_path / name, max_bytes=2**30), seed=4)
            return make_loader(ds, batch_size=4, num_workers=2, persistent_workers=True), ds

        whole, ds = build("a")
        expected = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            expected.append([b["cls"].tolist() for b in whole])
        first, ds = build("b")
        ds.set_epoch(0)
        list(first)
        ds.set_epoch(1)
        iterator = iter(first)
        prefix = [next(iterator)["cls"].tolist() for _ in range(7)]
        state = json.loads(json.dumps(first.state_dict()))
        del iterator
        second, ds2 = build("c")
        ds2.set_epoch(1)
        second.load_state_dict(state)
        rest = [b["cls"].tolist() for b in second]
        assert sorted(i for b in prefix + rest for i in b) == list(range(90))
        assert prefix + rest == expected[1]
        ds2.set_epoch(2)
        assert [b["cls"].tolist() for b in second] == expected[2]
