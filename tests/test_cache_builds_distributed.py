"""build_token_cache, build_spectrogram_cache and build_image_cache under torchrun (2 gloo
processes, issue #11): the ranks split the work, rank 0 publishes folders byte-identical to
single-process builds, and a rank that dies mid-build leaves nothing published (the next build
sweeps its temp). One launch builds all three caches; the dying image build is in
tests/vision/cache/test_image_cache_distributed.py, and the dying token build, the same FolderBuild
protocol as the spectrogram one, is in the slow tier."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache
from recipes.nlp import build_token_cache
from recipes.testing import make_audio_files, make_image_folder, make_text_corpus, train_tokenizer
from recipes.vision import ImageFolderFast, build_image_cache

SCRIPT = Path(__file__).with_name("dist_cache_builds_script.py")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    texts = make_text_corpus(101, median_words=15, seed=3)
    (folder / "texts.txt").write_text("\n".join(texts) + "\n")
    train_tokenizer(texts, vocab_size=500).save_pretrained(folder / "tokenizer")
    make_audio_files(folder / "audio", seconds=[2.5, 1.2, 3.0], sample_rate=8000, seed=2)
    make_image_folder(folder / "tree", classes=3, per_class=5, size=(160, 120), seed=8)
    return folder


@pytest.fixture
def work(inputs, tmp_path):
    for name in ("texts.txt", "tokenizer", "audio", "tree"):
        source = inputs / name
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, tmp_path / name)
    return tmp_path


def _torchrun(work, mode):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SCRIPT),
            str(work),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )


def _single_builds(work, out):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer", local_files_only=True)
    tokens = build_token_cache(
        work / "texts.txt", tokenizer, out / "tokens", batch_size=7, progress=False
    )
    audio = ChunkedAudioDataset(
        sorted(map(str, (work / "audio").iterdir())), chunk_seconds=1.0, last_chunk="keep"
    )
    features = build_spectrogram_cache(
        audio, out / "features", n_mels=32, num_workers=0, progress=False
    )
    return tokens, features


def _files(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow  # torchrun, 10 s: in the full suite (CI)
def test_distributed_builds_equal_single_process_builds(work):
    out = _torchrun(work, "ok")
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, features = _single_builds(work, work / "single")
    build_image_cache(
        ImageFolderFast(work / "tree", size=64),
        work / "single" / "images",
        num_workers=0,
        progress=False,
    )
    assert features.header["layout"] == "ragged"  # windows of unequal length: the harder join
    for name in ("tokens", "features", "images"):
        single = _files(work / "single" / name)
        assert single and _files(work / "split" / name) == single, name
    assert sorted(p.name for p in (work / "split").iterdir()) == [
        "features",
        "images",
        "tokens",
    ]  # no temp left
    assert [p.name for p in (work / "split" / "images").iterdir()] == [
        p.name for p in (work / "single" / "images").iterdir()
    ]


@pytest.mark.parametrize(
    "domain",
    [pytest.param("nlp", marks=pytest.mark.slow), pytest.param("audio", marks=pytest.mark.slow)],
)
def test_a_rank_that_dies_mid_build_publishes_nothing(work, domain):
    out = _torchrun(work, f"die-{domain}")
    assert out.returncode != 0
    published = {p.name for p in (work / "split").iterdir() if not p.name.startswith(".")}
    assert published == (
        {"tokens"} if domain == "audio" else set()
    )  # the build that died is not there
    tokens, features = _single_builds(work, work / "split")  # the next build sweeps the dead temp
    assert len(features) and len(tokens)
    assert sorted(p.name for p in (work / "split").iterdir()) == ["features", "tokens"]
