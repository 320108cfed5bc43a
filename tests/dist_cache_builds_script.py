"""Run under torchrun (2 gloo processes): build_token_cache, build_spectrogram_cache and (`ok`
only) build_image_cache split across ranks. `die-nlp` / `die-audio`: rank 1 exits midway through
its share of that build (as a killed node would)."""

import datetime
import os
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer

import recipes.audio.spectrogram_cache as spectrogram_cache
import recipes.nlp.token_cache as token_cache
from recipes.audio import ChunkedAudioDataset, build_spectrogram_cache
from recipes.nlp import build_token_cache
from recipes.vision import ImageFolderFast, build_image_cache


def dies_on_rank_1(make):
    """`make`'s callable, but rank 1 exits on its second call."""
    calls = [0]

    def wrapped(*args, **kwargs):
        inner = make(*args, **kwargs)

        def call(*a, **k):
            calls[0] += 1
            if dist.get_rank() == 1 and calls[0] == 2:
                os._exit(3)
            return inner(*a, **k)

        return call

    return wrapped


def main(work: str, mode: str) -> None:
    work = Path(work)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if mode == "die-nlp":
        token_cache.batch_encoder = dies_on_rank_1(token_cache.batch_encoder)
    if mode == "die-audio":
        spectrogram_cache.featurizer = dies_on_rank_1(spectrogram_cache.featurizer)
    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer", local_files_only=True)
    tokens = build_token_cache(
        work / "texts.txt",
        tokenizer,
        work / "split" / "tokens",
        batch_size=7,
        progress=False,
        distributed=True,
    )
    assert len(tokens) == len((work / "texts.txt").read_text().splitlines())
    audio = ChunkedAudioDataset(
        sorted(map(str, (work / "audio").iterdir())), chunk_seconds=1.0, last_chunk="keep"
    )
    features = build_spectrogram_cache(
        audio,
        work / "split" / "features",
        n_mels=32,
        num_workers=1,
        progress=False,
        distributed=True,
    )
    assert len(features) == len(audio)
    if mode == "ok":
        images = ImageFolderFast(work / "tree", size=64)
        build_image_cache(
            images, work / "split" / "images", num_workers=0, progress=False, distributed=True
        )
        assert images[0][0].shape == (3, 64, 64)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
