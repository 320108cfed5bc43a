"""Mutation fuzz of real files, per modality (issue #10): truncations, bit flips, zeroed ranges and
spliced bytes. Every case must give a valid item or the project's typed error, naming the file,
within a time bound, and in a process whose address space is capped (a header that asks for
519 GB must fail as an error, not as the OOM killer)."""

import json
import textwrap

import pytest

HARNESS = textwrap.dedent('''
    import json, resource, sys, traceback
    from pathlib import Path
    import numpy as np

    def mutations(data, rng, count):
        """(name, bytes) cases from one real file."""
        n = len(data)
        for k in range(count):
            kind = ("truncate", "flip", "zero", "splice")[k % 4]
            out = bytearray(data)
            if kind == "truncate":
                out = out[: int(rng.integers(1, n))]
            elif kind == "flip":
                for pos in rng.integers(0, n, int(rng.integers(1, 12))):
                    out[pos] ^= 1 << int(rng.integers(0, 8))
            elif kind == "zero":
                a = int(rng.integers(0, n))
                zeros = bytes(min(256, n - a))[: len(out[a : a + 256])]
                out[a : a + int(rng.integers(1, 256))] = zeros
            else:
                a, b = sorted(rng.integers(0, n, 2).tolist()); c = int(rng.integers(0, n))
                out = out[:c] + bytes(data[a:b]) + out[c:]
            yield f"{kind}{k}", bytes(out)

    def main(modalities, folder, count):
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # 6 GiB of address space
        everything = {}
        for modality in modalities.split(","):
            (Path(folder) / modality).mkdir()
            everything[modality] = fuzz(modality, Path(folder) / modality, count)
        print(json.dumps(everything))

    def fuzz(modality, folder, count):
        rng = np.random.default_rng(7)
        outcomes = {"valid": 0, "typed": 0, "other": []}
        def record(name, fn, typed):
            try:
                fn()
                outcomes["valid"] += 1
            except typed as error:
                if name not in str(error):
                    outcomes["other"].append(f"{name}: typed error without the file name: {error}")
                outcomes["typed"] += 1
            except BaseException as error:
                outcomes["other"].append(f"{name}: {type(error).__name__}: {error}"[:300])
        if modality == "vision":
            from recipes.testing import make_image_folder
            from recipes.vision import ImageDecodeError, ImageFolderFast
            import cv2
            src = make_image_folder(folder / "src", classes=1, per_class=2, seed=1)
            originals = sorted(src.rglob("*.jpg"))
            cv2.imwrite(str(folder / "src.png"), cv2.imread(str(originals[0])))
            originals.append(folder / "src.png")
            target = folder / "tree" / "c"
            target.mkdir(parents=True)
            for i, orig in enumerate(originals):
                for name, data in mutations(orig.read_bytes(), rng, count // len(originals)):
                    (target / f"m{i}_{name}{orig.suffix}").write_bytes(data)
            ds = ImageFolderFast(folder / "tree", size=96, train=True)
            for i in range(len(ds)):
                def item(i=i):
                    image, _ = ds[i]
                    assert image.shape == (3, 96, 96)
                record(Path(ds.paths[i]).name, item, ImageDecodeError)
        elif modality == "audio":
            from recipes.audio import AudioDecodeError, ChunkedAudioDataset
            from recipes.testing import make_audio_files
            originals = []
            for seed, fmt in enumerate(("WAV", "FLAC", "OGG"), start=1):
                src = folder / ("src" if seed == 1 else f"src{seed}")
                originals += make_audio_files(src, count=1, seconds=1.5, format=fmt, seed=seed)
            for i, orig in enumerate(originals):
                for name, data in mutations(orig.read_bytes(), rng, count // len(originals)):
                    path = folder / f"m{i}_{name}{orig.suffix}"
                    path.write_bytes(data)
                    def items(path=path):
                        ds = ChunkedAudioDataset([path], chunk_seconds=0.5, sample_rate=16000)
                        for j in sorted({0, 1, len(ds) - 2, len(ds) - 1} & set(range(len(ds)))):
                            wave, info = ds[j]
                            assert wave.shape == (1, 8000) and np.isfinite(wave.numpy()).all()
                    record(path.name, items, AudioDecodeError)
        else:
            from recipes.testing import make_text_corpus, train_tokenizer
            from recipes.nlp import build_token_cache
            texts = make_text_corpus(60, seed=1)
            tokenizer = train_tokenizer(texts, vocab_size=300)
            lines = [t.replace("\\n", " ") for t in texts]
            (folder / "src.txt").write_text("\\n".join(lines) + "\\n")
            records = [json.dumps({"text": t}) + "\\n" for t in texts]
            (folder / "src.jsonl").write_text("".join(records))
            for orig in (folder / "src.txt", folder / "src.jsonl"):
                for name, data in mutations(orig.read_bytes(), rng, count // 2):
                    path = folder / f"m_{name}{orig.suffix}"
                    path.write_bytes(data)
                    def build(path=path):
                        target = folder / ("c_" + path.name)
                        cache = build_token_cache(str(path), tokenizer, target, progress=False)
                        if len(cache):
                            assert cache[len(cache) - 1]["input_ids"].ndim == 1
                    record(path.name, build, ValueError)
        return outcomes

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
''')


CASES = 60  # mutated files per modality


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, zygote):
    """The harness run once, in one capped process, over every modality: {modality: outcomes}."""
    folder = tmp_path_factory.mktemp("fuzz")
    done = zygote.python(HARNESS, "vision,audio,text", folder, CASES)
    assert done.wait(timeout=600) == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("modality", ["vision", "audio", "text"])
def test_mutated_files_give_items_or_typed_errors(modality, fuzzed):
    outcomes = fuzzed[modality]
    assert outcomes["other"] == [], outcomes["other"]
    assert outcomes["valid"] + outcomes["typed"] >= CASES - 3
    assert outcomes["typed"] > 0 and outcomes["valid"] > 0  # the mutations hit both ways
