"""Damage is never served (issue 27, the cache part): per-item checksums in the image cache (whole
images and eval views), the token cache and the spectrogram cache; a damaged header reported as
damaged, not stale; a missing or damaged eval view warns; `recipes cache verify DIR`; and a fuzz
that flips random bytes in every file of each cache and compares what is served with an
independent expectation (the uncached decode, the tokenizer, the featurizer on the fly)."""

import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache
from recipes.audio.spectrogram_cache import SpectrogramCache, SpectrogramCacheError, featurizer
from recipes.cli import main
from recipes.nlp import build_token_cache
from recipes.nlp.token_cache import TokenCache, TokenCacheError
from recipes.testing import make_audio_files, make_image_folder, make_text_corpus, train_tokenizer
from recipes.vision import ImageCache, ImageCacheError, ImageFolderFast, build_image_cache
from recipes.vision.cache.eval_view import find_eval_view


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("tree"), classes=2, per_class=3, seed=21)


@pytest.fixture(scope="module")
def texts():
    return make_text_corpus(40, median_words=12, seed=3) + [""]


@pytest.fixture(scope="module")
def tokenizer(texts):
    return train_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    return make_audio_files(
        tmp_path_factory.mktemp("audio"), seconds=[1.2, 0.5], sample_rate=16000, seed=2
    )


def _flip(path, offset, mask=1):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def _eval_cache(tree, folder):
    ds = ImageFolderFast(tree, size=48, max_side=96)
    build_image_cache(ds, folder, num_workers=0, progress=False)
    return ds


# ---- item 6: content damage is detected before it is served --------------------------------
def test_a_flipped_byte_in_the_eval_view_raises_naming_it(tree, tmp_path):
    ds = _eval_cache(tree, tmp_path)
    view = ds.eval_view
    _flip(view.path, 3 * 48 * 48 * 3 + 100)  # image 3
    fresh = ImageFolderFast(tree, size=48, max_side=96, cache_dir=tmp_path)
    assert torch.equal(fresh[2][0], fresh.eval_record(2))
    rows = np.zeros((48, 48, 3), np.uint8)
    for read in (
        lambda: fresh[3],
        lambda: fresh.read_batch([2, 3], np.random.default_rng(0)),
        lambda: fresh.__getitems__([3]),
        lambda: fresh.eval_view.read_into([rows[r] for r in range(48)], 3),
    ):
        with pytest.raises(
            ImageCacheError, match=r"eval-48x48-crop0.875.bin is damaged: image 3 has checksum"
        ):
            read()


@pytest.mark.parametrize("train", [True, False])
def test_a_flipped_byte_in_images_bin_raises_naming_it(tree, tmp_path, train):
    ds = _eval_cache(tree, tmp_path)
    cache = ds.cache
    _flip(cache.path / "images.bin", int(cache.offsets[4]) + 7)
    fresh = ImageFolderFast(tree, size=48, max_side=96, train=train, cache_dir=tmp_path)
    fresh._cached.views[(48, 48)] = None  # eval: the whole-image path
    with pytest.raises(ImageCacheError, match=r"images.bin is damaged: image 4"):
        fresh[4]
    with pytest.raises(ImageCacheError, match=r"images.bin is damaged: image 4"):
        fresh.read_batch([1, 4], np.random.default_rng(0))
    with pytest.raises(ImageCacheError, match=r"images.bin is damaged: image 4"):
        fresh.cache.read_padded(4, np.zeros((96, 96, 3), np.uint8))
    assert fresh[1][0].shape == (3, 48, 48)


def test_first_read_is_per_process_and_always_sees_later_damage(tree, tmp_path):
    ds = _eval_cache(tree, tmp_path)
    cache = ImageCache.open(ds.cache.path)
    assert cache.checks.verify == "first_read"
    with pytest.raises(ValueError, match="`verify` must be one of"):
        ImageCache.open(ds.cache.path, verify="sometimes")
    cache.read(0)
    flags = cache.checks._flags()
    assert (
        isinstance(flags, np.ndarray)
        and flags.dtype == bool
        and flags.tolist() == [True] + [False] * 5
    )
    _flip(cache.path / "images.bin", 10)  # after image 0's first read in this process
    cache.read(0)  # first_read: verified once per process, not again
    pid = os.fork()
    if pid == 0:  # a forked worker starts with nothing verified
        try:
            cache.read(0)
            os._exit(1)
        except ImageCacheError:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    cache.checks.verify = "always"
    with pytest.raises(ImageCacheError, match="images.bin is damaged: image 0"):
        cache.read(0)
    cache.checks.verify = "never"
    cache.read(0)  # never: served unchecked (documented)


def test_a_flipped_token_raises_naming_tokens_bin(texts, tokenizer, tmp_path):
    cache = build_token_cache(texts, tokenizer, tmp_path / "c", progress=False)
    _flip(tmp_path / "c" / "tokens.bin", int(cache.offsets[5]) * 2)
    fresh = TokenCache.open(tmp_path / "c")
    assert fresh[4]["input_ids"].tolist() == tokenizer(texts[4])["input_ids"]
    for read in (lambda: fresh[5], lambda: fresh.__getitems__([4, 5])):
        with pytest.raises(TokenCacheError, match=r"tokens.bin is damaged: sample 5"):
            read()


def test_a_flipped_feature_raises_naming_features_bin(audio, tmp_path):
    ds = ChunkedAudioDataset(audio, chunk_seconds=0.25)
    cache = build_spectrogram_cache(ds, tmp_path / "c", n_mels=16, num_workers=0, progress=False)
    _flip(tmp_path / "c" / "features.bin", int(cache.offsets[2]) * 16 * 2 + 5)
    fresh = SpectrogramCache.open(tmp_path / "c")
    for read in (lambda: fresh[2], lambda: fresh.__getitems__([1, 2])):
        with pytest.raises(SpectrogramCacheError, match=r"features.bin is damaged: item 2"):
            read()


# ---- item 8: a damaged header is "damaged", not "built from other inputs" -------------------
@pytest.mark.parametrize("kind", ["image", "token", "spectrogram"])
def test_a_bit_flip_in_the_header_is_reported_as_damaged(
    kind, tree, texts, tokenizer, audio, tmp_path
):
    if kind == "image":
        folder, opener, error = (
            _eval_cache(tree, tmp_path).cache.path,
            ImageCache.open,
            ImageCacheError,
        )
        fingerprint = json.loads((folder / "header.json").read_text())["fingerprint"]
    elif kind == "token":
        cache = build_token_cache(texts, tokenizer, tmp_path / "c", progress=False)
        folder, opener, error, fingerprint = (
            cache.path,
            TokenCache.open,
            TokenCacheError,
            cache.fingerprint,
        )
    else:
        cache = build_spectrogram_cache(
            ChunkedAudioDataset(audio, chunk_seconds=0.25),
            tmp_path / "c",
            n_mels=16,
            num_workers=0,
            progress=False,
        )
        folder, opener, error, fingerprint = (
            cache.path,
            SpectrogramCache.open,
            SpectrogramCacheError,
            cache.fingerprint,
        )
    text = (folder / "header.json").read_text()
    at = (
        text.index(fingerprint) + 3
    )  # a bit of the fingerprint: used to read "built from other inputs"
    _flip(folder / "header.json", at)
    with pytest.raises(error, match="header.json is damaged") as caught:
        opener(folder, fingerprint=fingerprint)
    assert "other inputs" not in str(caught.value)
    (folder / "header.json").write_text(text.replace('"count"', '"count"\x01'))  # not JSON any more
    with pytest.raises(error, match="header.json is damaged"):
        opener(folder, fingerprint=fingerprint)
    old = {k: v for k, v in json.loads(text).items() if k != "header_sha256"}
    (folder / "header.json").write_text(
        json.dumps({**old, "version": old["version"] - 1})
    )  # an older format
    with pytest.raises(error, match=r"holds format .* v\d+, expected"):
        opener(folder, fingerprint=fingerprint)


# ---- item 7: a missing or damaged eval view warns once, naming it ---------------------------
def test_a_missing_or_damaged_eval_view_warns_naming_it(tree, tmp_path):
    ds = _eval_cache(tree, tmp_path)
    header = ds.cache.path / "eval-48x48-crop0.875.json"
    _flip(header, 20)
    fresh = ImageFolderFast(tree, size=48, max_side=96, cache_dir=tmp_path)
    with pytest.warns(
        UserWarning,
        match=r"No usable eval view eval-48x48-crop0.875 in .*: eval-48x48-crop0.875.json "
        r"is damaged.*5x slower.*build_image_cache\(dataset\)",
    ):
        assert fresh[0][0].shape == (3, 48, 48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh[1]  # once
    fresh.set_resolution(32)
    with pytest.warns(
        UserWarning,
        match=r"No usable eval view eval-32x32-crop0.875 .*there is no "
        r"eval-32x32-crop0.875.json.*recipes cache vision ROOT CACHE_DIR --size 32",
    ):
        fresh[0]
    sums = ds.cache.path / "eval-48x48-crop0.875.sums"
    build_image_cache(fresh, tmp_path, num_workers=0, progress=False)  # rebuilds the view at 32
    _flip(sums, 3)
    view, why = find_eval_view(
        ds.cache.path, ds.cache.fingerprint, 6, (48, 48), 0.875, ImageCacheError
    )
    assert view is None and "damaged" in why


# ---- recipes cache verify DIR ----------------------------------------------------------------
def test_cache_verify_names_damaged_items_and_exits_non_zero(
    tree, texts, tokenizer, tmp_path, capsys
):
    ds = _eval_cache(tree, tmp_path / "images")
    tokens = build_token_cache(texts, tokenizer, tmp_path / "tokens", progress=False)
    assert main(["cache", "verify", str(tmp_path / "images")]) == 0
    assert main(["cache", "verify", str(tmp_path / "tokens")]) == 0
    assert "12 items checked, ok" in capsys.readouterr().out  # 6 images + 6 eval rows
    _flip(ds.cache.path / "images.bin", int(ds.cache.offsets[2]) + 1)
    _flip(ds.eval_view.path, 5 * 48 * 48 * 3)
    _flip(tmp_path / "tokens" / "tokens.bin", int(tokens.offsets[7]) * 2)
    assert main(["cache", "verify", str(tmp_path / "images")]) == 1
    out = capsys.readouterr().out
    assert (
        "images.bin: 1 of 6 images damaged: 2" in out
        and "eval-48x48-crop0.875.bin: 1 of 6 images damaged: 5" in out
    )
    assert main(["cache", "verify", str(tmp_path / "tokens")]) == 1
    assert "tokens.bin: 1 of 41 samples damaged: 7" in capsys.readouterr().out
    _flip(tmp_path / "tokens" / "offsets.bin", 9)
    assert main(["cache", "verify", str(tmp_path / "tokens")]) == 1
    assert "offsets.bin is damaged" in capsys.readouterr().out
    assert main(["cache", "verify", str(tmp_path / "nothing")]) == 1


# ---- B1: damage found is recorded, and the build function rebuilds instead of reusing ---------
def _kind(kind, tree, texts, tokenizer, audio, folder):
    """`(build, served, expected, damage, read, opener, error, hint)` of one cache kind: `damage`
    flips a byte of item `at` of the built cache's data file; `read` reads that item freshly."""
    if kind == "image":
        files = ImageFolderFast(tree, size=48, max_side=96, train=True)  # the uncached decode
        return (
            lambda: build_image_cache(
                ImageFolderFast(tree, size=48, max_side=96, train=True),
                folder,
                num_workers=0,
                progress=False,
            ),
            lambda c: [c.read(i) for i in range(c.count)],
            [files.cache_record(i)[0] for i in range(6)],
            lambda c: _flip(c.path / "images.bin", int(c.offsets[4]) + 7),
            lambda c: ImageCache.open(c.path).read(4),
            ImageCache.open,
            ImageCacheError,
            r"images.bin image 4 .*build_image_cache\(\)",
        )
    if kind == "token":
        return (
            lambda: build_token_cache(texts, tokenizer, folder, progress=False),
            lambda c: [c[i]["input_ids"].tolist() for i in range(len(c))],
            tokenizer(texts)["input_ids"],
            lambda c: _flip(c.path / "tokens.bin", int(c.offsets[5]) * 2),
            lambda c: TokenCache.open(c.path)[5],
            TokenCache.open,
            TokenCacheError,
            r"tokens.bin sample 5 .*build_token_cache\(\)",
        )
    ds = ChunkedAudioDataset(audio, chunk_seconds=0.25)
    mel = featurizer(ds.sample_rate, n_fft=400, hop_length=160, n_mels=16, log=True)  # on the fly
    return (
        lambda: build_spectrogram_cache(ds, folder, n_mels=16, num_workers=0, progress=False),
        lambda c: [c[i][0].numpy() for i in range(len(c))],
        [mel(ds[i][0]).numpy().astype(np.float16).astype(np.float32) for i in range(len(ds))],
        lambda c: _flip(c.path / "features.bin", int(c.offsets[2]) * 16 * 2 + 5),
        lambda c: SpectrogramCache.open(c.path)[2],
        SpectrogramCache.open,
        SpectrogramCacheError,
        r"features.bin item 2 .*build_spectrogram_cache\(\)",
    )


def _assert_served(served, expected):
    assert len(served) == len(expected)
    assert all(
        np.array_equal(np.asarray(got), np.asarray(want))
        for got, want in zip(served, expected, strict=True)
    )


@pytest.mark.parametrize("found_by", ["read", "verify"])
@pytest.mark.parametrize("kind", ["image", "token", "spectrogram"])
def test_damage_found_makes_the_build_function_rebuild(
    kind, found_by, tree, texts, tokenizer, audio, tmp_path, capsys
):
    folder = tmp_path / "c"
    build, served, expected, damage, read, opener, error, hint = _kind(
        kind, tree, texts, tokenizer, audio, folder
    )
    cache = build()
    damage(cache)
    if found_by == "read":
        with pytest.raises(
            error, match=r"is damaged: .*Rebuild the cache with build_.*which replaces it"
        ):
            read(cache)
    else:
        assert main(["cache", "verify", str(folder)]) == 1
        assert "recorded in damaged.json; rebuild with build_" in capsys.readouterr().out
    with pytest.raises(error, match=rf"is damaged: {hint}.*which replaces it"):
        opener(cache.path)  # recorded: the folder no longer opens as a valid cache
    rebuilt = build()  # no longer the damaged cache reused
    assert not (rebuilt.path / "damaged.json").exists()
    _assert_served(served(rebuilt), expected)
    _assert_served(served(opener(rebuilt.path)), expected)
    assert main(["cache", "verify", str(folder)]) == 0


@pytest.mark.parametrize("found_by", ["read", "verify"])
def test_a_damaged_eval_view_is_rebuilt_alone(found_by, tree, tmp_path, capsys):
    ds = _eval_cache(tree, tmp_path)
    images, view = ds.cache.path / "images.bin", ds.eval_view.path
    before = images.stat().st_ino
    _flip(view, 3 * 48 * 48 * 3 + 100)  # image 3
    if found_by == "read":
        with pytest.raises(
            ImageCacheError,
            match=r"eval-48x48-crop0.875.bin is damaged: image 3.*which replaces it",
        ):
            ImageFolderFast(tree, size=48, max_side=96, cache_dir=tmp_path)[3]
    else:
        assert main(["cache", "verify", str(tmp_path)]) == 1
        assert (
            "eval-48x48-crop0.875.bin: 1 of 6 images damaged: 3; recorded"
            in capsys.readouterr().out
        )
    fresh = ImageFolderFast(
        tree, size=48, max_side=96, cache_dir=tmp_path
    )  # the whole images stay usable
    with pytest.warns(
        UserWarning,
        match=r"eval-48x48-crop0.875 in .*: damaged: eval-48x48-crop0.875.bin image 3 failed",
    ):
        assert fresh.eval_view is None
    build_image_cache(fresh, tmp_path, num_workers=0, progress=False)
    assert (
        images.stat().st_ino == before and not (ds.cache.path / "damaged.json").exists()
    )  # the view alone
    files = ImageFolderFast(tree, size=48, max_side=96)  # uncached: the full decode
    again = ImageFolderFast(tree, size=48, max_side=96, cache_dir=tmp_path)
    assert again.eval_view is not None
    assert all(torch.equal(again[i][0], files.eval_record(i)) for i in range(6))
    assert main(["cache", "verify", str(tmp_path)]) == 0


def test_damage_that_cannot_be_recorded_says_to_remove_the_folder(
    texts, tokenizer, tmp_path, monkeypatch
):
    cache = build_token_cache(texts, tokenizer, tmp_path / "c", progress=False)
    _flip(tmp_path / "c" / "tokens.bin", int(cache.offsets[5]) * 2)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("recipes.common.caches.cache_checks.tempfile.mkstemp", read_only)
    with pytest.raises(
        TokenCacheError, match=r"could not be recorded \(.*Permission denied\): remove .*c, then"
    ):
        TokenCache.open(tmp_path / "c")[5]
    assert not (tmp_path / "c" / "damaged.json").exists()


# ---- the fuzz ---------------------------------------------------------------------------------
def _fuzz(folder, opener, error, serve, expected, trials, tmp_path, seed):
    """Flips 1-8 random bits of one random file of a copy of `folder` per trial; every item
    served must equal `expected` or raise `error` naming a file of the cache."""
    rng = np.random.default_rng(seed)
    files = sorted(p.name for p in folder.iterdir())
    outcomes = {"refused": 0, "served": 0, "raised": 0}
    for trial in range(trials):
        copy = tmp_path / f"trial{trial}" / folder.name
        shutil.copytree(folder, copy)
        name = files[trial % len(files)]
        size = (copy / name).stat().st_size
        for at in rng.integers(0, size, int(rng.integers(1, 9))):
            _flip(copy / name, int(at), 1 << int(rng.integers(0, 8)))
        try:
            cache = opener(copy)
        except error as why:
            assert str(copy) in str(why), why
            outcomes["refused"] += 1
            continue
        for i, want in enumerate(expected):
            try:
                got = serve(cache, i)
            except error as why:
                assert str(copy) in str(why), why
                outcomes["raised"] += 1
                continue
            assert np.array_equal(got, want), (
                f"trial {trial}: {name} flipped, item {i} served changed"
            )
            outcomes["served"] += 1
        shutil.rmtree(copy.parent)
    assert outcomes["refused"] and outcomes["raised"] and outcomes["served"], outcomes
    return outcomes


def _image_fuzz(tree, tmp_path, trials):
    ds = _eval_cache(tree, tmp_path / "build")
    folder, fingerprint = ds.cache.path, ds.cache.fingerprint
    files = ImageFolderFast(
        tree, size=48, max_side=96
    )  # the uncached decode: independent of the cache
    expected = [files.cache_record(i)[0] for i in range(6)] + [
        files.eval_record(i).permute(1, 2, 0).numpy() for i in range(6)
    ]

    def opener(path):
        cache = ImageCache.open(path, fingerprint=fingerprint)
        cache.check_labels(files.targets)
        view, why = find_eval_view(path, fingerprint, 6, (48, 48), 0.875, ImageCacheError)
        if view is None:
            raise ImageCacheError(f"{path}: {why}")  # the dataset warns and serves the whole images
        return cache, view

    def serve(opened, i):
        cache, view = opened
        return cache.read(i) if i < 6 else view.read_into(np.empty((48, 48, 3), np.uint8), i - 6)

    _fuzz(folder, opener, ImageCacheError, serve, expected, trials, tmp_path, seed=1)


def _token_fuzz(texts, tokenizer, tmp_path, trials):
    cache = build_token_cache(texts, tokenizer, tmp_path / "build", progress=False)
    expected = [np.array(ids) for ids in tokenizer(texts)["input_ids"]]  # direct tokenization
    _fuzz(
        cache.path,
        lambda p: TokenCache.open(p, fingerprint=cache.fingerprint),
        TokenCacheError,
        lambda c, i: c[i]["input_ids"].numpy(),
        expected,
        trials,
        tmp_path,
        seed=2,
    )


def _spectrogram_fuzz(audio, tmp_path, trials):
    ds = ChunkedAudioDataset(audio, chunk_seconds=0.25)
    cache = build_spectrogram_cache(
        ds, tmp_path / "build", n_mels=16, num_workers=0, progress=False
    )
    mel = featurizer(ds.sample_rate, n_fft=400, hop_length=160, n_mels=16, log=True)  # on the fly
    expected = [mel(ds[i][0]).numpy().astype(np.float16).astype(np.float32) for i in range(len(ds))]
    _fuzz(
        cache.path,
        lambda p: SpectrogramCache.open(p, fingerprint=cache.fingerprint),
        SpectrogramCacheError,
        lambda c, i: c[i][0].numpy(),
        expected,
        trials,
        tmp_path,
        seed=3,
    )


@pytest.mark.parametrize("kind", ["image", "token", "spectrogram"])
def test_fuzz_random_bit_flips_in_every_cache_file_are_never_served(
    kind, tree, texts, tokenizer, audio, tmp_path
):
    trials = {"image": 40, "token": 40, "spectrogram": 30}[kind]
    _run_fuzz(kind, tree, texts, tokenizer, audio, tmp_path, trials)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["image", "token", "spectrogram"])
def test_fuzz_long(kind, tree, texts, tokenizer, audio, tmp_path):
    _run_fuzz(kind, tree, texts, tokenizer, audio, tmp_path, 600)


def _run_fuzz(kind, tree, texts, tokenizer, audio, tmp_path, trials):
    if kind == "image":
        _image_fuzz(tree, tmp_path, trials)
    elif kind == "token":
        _token_fuzz(texts, tokenizer, tmp_path, trials)
    else:
        _spectrogram_fuzz(audio, tmp_path, trials)
