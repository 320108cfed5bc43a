"""Recipe files copy on their own (issue #11): each one, with at most two helper files of this
project, is copied into an empty folder, its imports rewritten to plain module imports, and
imported and exercised in a process where the `recipes` package cannot be imported at all.
The seven recipe files of the issue are all here, and no other project file may be needed."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# recipe file -> (its helpers, a smoke run of the copy)
RECIPES = {
    "common/bucketing.py": (["common/sharding.py", "common/loader_warning.py"], """
        from bucketing import LengthBucketSampler
        sampler = LengthBucketSampler([5, 9, 3, 12, 7, 7, 2, 30], max_tokens=32, seed=0)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(8))
        assert sampler.state_dict(batches_done=1)["global_batches_done"] == 1
    """),
    "common/prefetch_cache.py": (["common/storage.py"], """
        from pathlib import Path
        from prefetch_cache import PrefetchCache
        src = Path("remote.bin"); src.write_bytes(b"x" * 1000)
        cache = PrefetchCache("cache", max_bytes=10_000)
        assert cache.get(str(src.resolve())).read_bytes() == b"x" * 1000
        assert cache.stats()["misses"] == 1
    """),
    "common/sharded_dataset.py": (["common/storage.py", "common/sharding.py"], """
        from pathlib import Path
        from sharded_dataset import ShardedIterableDataset
        paths = []
        for s in range(3):
            Path(f"s{s}.txt").write_text(" ".join(str(10 * s + i) for i in range(4))); paths.append(f"s{s}.txt")
        ds = ShardedIterableDataset(paths, lambda p: [int(x) for x in Path(p).read_text().split()], rank=0, world_size=1)
        assert sorted(ds) == sorted(10 * s + i for s in range(3) for i in range(4))
    """),
    "audio/chunked.py": (["common/storage.py"], """
        import numpy as np, soundfile as sf
        from chunked import ChunkedAudioDataset
        sf.write("a.wav", np.zeros(16000, np.float32), 16000)
        ds = ChunkedAudioDataset(["a.wav"], chunk_seconds=0.25)
        assert len(ds) == 4 and ds[3][0].shape == (1, 4000)
    """),
    "audio/spectrogram_cache.py": (["common/storage.py", "audio/chunked.py"], """
        import numpy as np, soundfile as sf
        from chunked import ChunkedAudioDataset
        from spectrogram_cache import build_spectrogram_cache
        sf.write("a.wav", np.random.default_rng(0).normal(0, 0.1, 16000).astype(np.float32), 16000)
        ds = ChunkedAudioDataset(["a.wav"], chunk_seconds=0.25)
        cache = build_spectrogram_cache(ds, "features", n_mels=40, num_workers=None, progress=False)
        assert len(cache) == 4 and cache[0][0].shape == (40, 26)
        assert build_spectrogram_cache(ds, "features", n_mels=40, num_workers=0, progress=False).path == cache.path
    """),
    "nlp/token_cache.py": (["common/storage.py", "nlp/texts.py"], """
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
        from token_cache import build_token_cache
        texts = ["the cat sat", "on the mat", "a dog ran far away", "the end"] * 5
        raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        raw.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
        cache = build_token_cache(texts, tokenizer, "tokens", batch_size=3, progress=False)
        assert [cache[i]["input_ids"].tolist() for i in range(len(texts))] == tokenizer(texts)["input_ids"]
    """),
    "vision/image_folder.py": (["common/storage.py", "vision/decode.py"], """
        import os, cv2, numpy as np, torch
        from image_folder import ImageFolderFast, build_image_cache
        ramp = np.tile(np.linspace(0, 200, 80), (60, 1))
        for c in range(2):
            os.makedirs(f"tree/c{c}")
            for i in range(3):
                cv2.imwrite(f"tree/c{c}/{i}.jpg", np.dstack([ramp, ramp * 0 + 10 * i, ramp[::-1]]).astype(np.uint8))
        ds = ImageFolderFast("tree", size=32)
        image, target = ds[4]
        assert image.shape == (3, 32, 32) and target == 1
        build_image_cache(ds, "cache", num_workers=None, progress=False)
        again = ImageFolderFast("tree", size=32, cache_dir="cache")
        assert again.cache is not None and (again[4][0].int() - image.int()).abs().float().mean() < 3
    """),
}


def _rewrite(text: str) -> str:
    """`from recipes.common.sharding import x` -> `from sharding import x`, and alike."""
    text = re.sub(r"from recipes\.\w+\.(\w+) import", r"from \1 import", text)
    return re.sub(r"from recipes\.\w+ import (\w+)( as \w+)?\n", r"import \1\2\n", text)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_file_copies_with_at_most_two_helpers(recipe, tmp_path):
    helpers, smoke = RECIPES[recipe]
    assert len(helpers) <= 2
    for name in [recipe, *helpers]:
        (tmp_path / Path(name).name).write_text(_rewrite((ROOT / name).read_text()))
    script = "import sys\nsys.modules['recipes'] = None  # the package is out of reach: only the copies\n"
    script += textwrap.dedent(smoke)
    (tmp_path / "use_it.py").write_text(script)
    done = subprocess.run([sys.executable, "use_it.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
