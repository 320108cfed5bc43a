"""Masked-language-model training with the recipes under Hugging Face Accelerate: a script to copy
and adapt.

    recipes template nlp --framework accelerate > train.py
    accelerate launch train.py --texts corpus.jsonl --tokenizer ./my_tokenizer --cache /nvme/tokens
    torchrun --nproc_per_node=8 train.py --texts corpus.jsonl --tokenizer ./my_tokenizer --cache
    /nvme/tokens python train.py --smoke            # a generated corpus, a tokenizer trained on the
    fly, a tiny BERT torchrun --nproc_per_node=2 train.py --smoke     # 2 processes on CPU (gloo)
    python train.py ... --mix code.jsonl --mix-weight 0.3   # two corpora at 0.7 / 0.3
    (MixtureSampler)

The plain template (`recipes template nlp`) with an `Accelerator` doing the distributed parts:
the process group, DDP, mixed precision, `accelerator.backward`, batches moved to the device,
and checkpoints with `accelerator.save_state()` / `load_state()`. The loader goes through
`prepare_loader` (common/frameworks/accelerate_glue.py), never `accelerator.prepare`, which
would rebuild it as a plain DataLoader (a `BatchSamplerShard` over the bucketed batches, no
state): checkpoints hold the loader's place, one JSON file per rank, and a resumed run starts
at the first batch it had not trained on, at once; on another number of ranks too (the
sampler's global position: elastic).

What to change for your data (lines marked ADAPT):
  - `build_model`: your network (a BERT masked LM from a `BertConfig`, no downloaded weights).
  - `--texts` (.txt, one sample per line, or .jsonl with `--text-field`), `--tokenizer` (a
    saved tokenizer folder), `--cache` (the token cache's folder), `MAX_LENGTH`.
  - `--max-tokens`: padded tokens per batch per rank (the memory a batch may use).
  - `--mix CORPUS --mix-weight W`: a second corpus drawn at weight W, mixed by
    `MixtureSampler` and then bucketed (see the plain template).
What each setting buys (measured; README "Benchmarks"): as in the plain template:
  - `build_token_cache`: tokenized once, read from a memory map (19-21x tokenizing in
    `__getitem__`).
  - `LengthBucketSampler(max_tokens=...)`, built after the `Accelerator` so that it reads the
    ranks: 6.5% padding, the same number of batches on every rank; `set_epoch` reshuffles.
  - `PadCollate`, the `text` profile, `LoaderMonitor`.
  - Checkpoints: `accelerator.save_state` into `checkpoints/step-N`, marked complete once every
    rank wrote its files; a restart resumes the newest complete one.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from recipes.common import (
    LengthBucketSampler,
    LoaderMonitor,
    MixtureSampler,
    MixtureSources,
    make_loader,
)
from recipes.common.frameworks.accelerate_glue import prepare_loader
from recipes.nlp import PadCollate, build_token_cache
from recipes.testing import make_text_corpus, train_tokenizer

MAX_LENGTH = 512  # ADAPT: the longest sample, in tokens (longer ones are truncated)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", help=".txt or .jsonl corpus, local or an fsspec URL")
    parser.add_argument("--tokenizer", type=Path, help="a saved tokenizer folder")
    parser.add_argument("--cache", type=Path, help="the token cache's folder")
    parser.add_argument("--text-field", default="text")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs/nlp"), help="checkpoints and logs"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--max-tokens", type=int, default=32768, help="padded tokens per batch per rank"
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--checkpoint-every", type=int, default=1000, help="steps between checkpoints"
    )
    parser.add_argument(
        "--mix",
        nargs="?",
        const="",
        help="a second corpus, mixed in at --mix-weight (with --smoke: a generated one)",
    )
    parser.add_argument(
        "--mix-weight", type=float, default=0.3, help="the second corpus's share (0-1)"
    )
    parser.add_argument("--smoke", action="store_true", help="generated data and a tiny model")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="exit after N steps (a simulated crash)"
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="log a hash of every sample trained on"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2
        args.max_tokens = 1024
        args.checkpoint_every = 1
    elif not (args.texts and args.tokenizer and args.cache):
        parser.error("--texts, --tokenizer and --cache are required (or --smoke)")
    if args.mix == "" and not args.smoke:
        parser.error("--mix needs the second corpus's path (only --smoke generates one)")
    if not 0 < args.mix_weight < 1:
        parser.error(f"--mix-weight must be between 0 and 1, not {args.mix_weight}")
    return args


def build_model(vocab_size: int, smoke: bool) -> torch.nn.Module:
    """ADAPT: your network."""
    from transformers import BertConfig, BertForMaskedLM

    size = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048)
    if smoke:  # a tiny model: the smoke test checks the loop, not the learning
        size = dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    return BertForMaskedLM(
        BertConfig(vocab_size=vocab_size, max_position_embeddings=MAX_LENGTH, **size)
    )


def prepare_data(args, accelerator):
    """(tokenizer, token cache): the corpus is tokenized once, split over the ranks."""
    from transformers import AutoTokenizer

    if args.smoke:
        args.texts = str(args.workdir / "corpus.txt")
        args.tokenizer = args.workdir / "tokenizer"
        args.cache = args.workdir / "tokens"
        if accelerator.is_main_process and not args.tokenizer.exists():
            texts = make_text_corpus(240, seed=0)
            Path(args.texts).write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n")
            train_tokenizer(texts, vocab_size=400).save_pretrained(args.tokenizer)
            if args.mix is not None:  # a second, smaller corpus
                second = make_text_corpus(60, seed=1)
                (args.workdir / "mix.txt").write_text(
                    "\n".join(t.replace("\n", " ") for t in second) + "\n"
                )
        if args.mix is not None:
            args.mix = str(args.workdir / "mix.txt")
    accelerator.wait_for_everyone()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    # Every rank tokenizes its share of the batches; rank 0 joins them and publishes the cache.
    cache = build_token_cache(
        args.texts,
        tokenizer,
        args.cache,
        max_length=MAX_LENGTH,
        text_field=args.text_field,
        distributed=accelerator.num_processes > 1,
    )
    if args.mix is None:
        return tokenizer, cache, None
    second = build_token_cache(
        args.mix,
        tokenizer,
        args.cache.with_name(args.cache.name + "-mix"),
        max_length=MAX_LENGTH,
        text_field=args.text_field,
        distributed=accelerator.num_processes > 1,
    )
    # one rank's view of the plan: LengthBucketSampler deals the mixed, bucketed batches over the
    # ranks
    mixture = MixtureSampler(
        {"texts": len(cache), "mix": len(second)},
        {"texts": 1 - args.mix_weight, "mix": args.mix_weight},
        num_samples=len(cache) + len(second),
        stop="never",
        seed=0,
        num_replicas=1,
        rank=0,
    )
    return tokenizer, MixtureSources([cache, second]), mixture


def mask_tokens(batch, mask_id: int, generator: torch.Generator):
    """BERT's masking: 15% of the real tokens become [MASK]; only those are predicted."""
    ids = batch["input_ids"]
    attention = batch["attention_mask"]
    chosen = (
        torch.rand(ids.shape, generator=generator, device=ids.device) < 0.15
    ) & attention.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return torch.where(chosen, torch.full_like(ids, mask_id), ids), attention, labels


class Progress:
    """The step count, saved and loaded with the checkpoint (`register_for_checkpointing`)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def save_checkpoint(accelerator, workdir: Path, step: int, keep: int = 2) -> None:
    """`save_state` on every rank into checkpoints/step-N, marked complete once all ranks wrote."""
    folder = workdir / "checkpoints" / f"step-{step:09d}"
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (folder / "complete").touch()
        for old in sorted(p.parent for p in folder.parent.glob("step-*/complete"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(workdir: Path) -> Path | None:
    done = sorted(p.parent for p in (workdir / "checkpoints").glob("step-*/complete"))
    if not done:
        return None
    return done[-1]


def print_epoch(epoch: int, seconds: float, loss: torch.Tensor | None, summary: dict) -> None:
    """One line per epoch: its time, its last loss, the share of the time spent waiting on data
    and, for a mixture, each source's realised share."""
    shares = ""
    if summary.get("sources"):
        shares = ", " + ", ".join(
            f"{name} {share:.0%}" for name, share in summary["sources"].items()
        )
    loss_text = "-"  # a resume at the epoch's end: no batch left
    if loss is not None:
        loss_text = f"{loss.item():.3f}"
    print(
        f"epoch {epoch}: {seconds:.1f} s, loss {loss_text}, "
        f"data wait {summary['wait_fraction']:.0%}{shares}",
        flush=True,
    )


def main(argv=None) -> None:
    from accelerate import Accelerator

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision="bf16" if cuda else "no"
    )  # cpu: gloo across processes
    rank = accelerator.process_index
    device = accelerator.device
    args.workdir.mkdir(parents=True, exist_ok=True)
    tokenizer, cache, mixture = prepare_data(args, accelerator)
    if mixture is None:
        lengths = cache.lengths
    else:  # every source's lengths, in the sources' order
        lengths = np.concatenate([d.lengths for d in cache.datasets])
    # built after the Accelerator: it reads the ranks from torch.distributed
    sampler = LengthBucketSampler(
        lengths, max_tokens=args.max_tokens, pad_to_multiple_of=8, seed=0, mixture=mixture
    )
    loader = prepare_loader(
        accelerator,
        LoaderMonitor(
            make_loader(cache, batch_sampler=sampler, collate_fn=PadCollate(tokenizer.pad_token_id))
        ),
    )  # batches on the device
    model = build_model(len(tokenizer), args.smoke)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    checkpoint = latest_checkpoint(args.workdir)
    if checkpoint is not None:  # resume: model, optimiser, random states, and the loader's place
        accelerator.load_state(str(checkpoint))
    generator = torch.Generator(device).manual_seed(rank)
    log = None
    if args.log_samples:
        log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    for epoch in range(
        loader.epoch, args.epochs
    ):  # the loader's state says which epoch to continue
        loader.set_epoch(epoch)
        start = time.perf_counter()
        loss = None
        for batch in loader:
            ids, attention, labels = mask_tokens(batch, tokenizer.mask_token_id, generator)
            with accelerator.autocast():
                loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            progress.step += 1
            if log is not None:  # one line per step: a hash of each sample's tokens
                log.write(
                    " ".join(
                        hashlib.sha1(row[:n].cpu().numpy().tobytes()).hexdigest()[:16]
                        for row, n in zip(
                            batch["input_ids"], batch["lengths"].tolist(), strict=True
                        )
                    )
                    + "\n"
                )
                log.flush()
            if progress.step % args.checkpoint_every == 0:
                save_checkpoint(accelerator, args.workdir, progress.step)
            if args.stop_after is not None and progress.step >= args.stop_after:
                accelerator.wait_for_everyone()
                os._exit(0)  # a simulated crash: no clean-up, as a killed job
        if progress.step % args.checkpoint_every:  # the epoch's end (the next epoch starts afresh)
            save_checkpoint(accelerator, args.workdir, progress.step)
        if accelerator.is_main_process:
            print_epoch(epoch, time.perf_counter() - start, loss, loader.summary())
    if accelerator.is_main_process:
        print(loader.report())
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
