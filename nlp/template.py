"""Masked-language-model training with the recipes: a complete script to copy and adapt.

    recipes template nlp > train.py
    python train.py --texts corpus.jsonl --tokenizer ./my_tokenizer --cache /nvme/tokens
    torchrun --nproc_per_node=8 train.py --texts corpus.jsonl --tokenizer ./my_tokenizer --cache
    /nvme/tokens python train.py --smoke            # a generated corpus, a tokenizer trained on the
    fly, a tiny BERT python train.py ... --mix code.jsonl --mix-weight 0.3   # two corpora at 0.7 /
    0.3 (MixtureSampler)

What to change for your data (lines marked ADAPT):
  - `build_model`: your network (a BERT masked LM from a `BertConfig`, no downloaded weights).
  - `--texts` (.txt, one sample per line, or .jsonl with `--text-field`), `--tokenizer` (a
    saved tokenizer folder), `--cache` (the token cache's folder), `MAX_LENGTH`.
  - `--max-tokens`: padded tokens per batch per rank (the memory a batch may use).
  - `--mix CORPUS --mix-weight W`: a second corpus drawn at weight W (the first at 1 - W),
    mixed by `MixtureSampler` and then bucketed; an epoch is as long as both corpora together,
    and a small corpus repeats (a fresh permutation each pass). `LoaderMonitor` reports the
    realised shares.
What each setting buys (measured; README "Benchmarks"):
  - `build_token_cache`: the corpus is tokenized once (faster than the tokenizer's own batch
    encode), then read from a memory map; tokenizing in `__getitem__` ran 19-21x slower.
  - `LengthBucketSampler(max_tokens=...)`: batches of similar lengths under a token budget:
    6.5% padding (1.4% without rounding to 8) against 77% for random batches, and every rank
    gets the same number of batches (no DDP hang); `set_epoch` reshuffles.
  - `PadCollate`: pads each batch to its own longest sample, in one shared buffer.
  - `make_loader`: the `text` profile (no pinning: small int batches copy faster unpinned).
  - `LoaderMonitor` and checkpoints with `loader.state_dict()`: as in the vision template.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from recipes.common import (
    LengthBucketSampler,
    LoaderMonitor,
    MixtureSampler,
    MixtureSources,
    make_loader,
)
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


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): torchrun's environment, or a single process."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    return dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local}" if cuda else "cpu")


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


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


def prepare_data(args, rank: int, world: int):
    """(tokenizer, token cache): the corpus is tokenized once, split over the ranks."""
    from transformers import AutoTokenizer

    if args.smoke:
        args.texts = str(args.workdir / "corpus.txt")
        args.tokenizer = args.workdir / "tokenizer"
        args.cache = args.workdir / "tokens"
        if rank == 0 and not args.tokenizer.exists():
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
    barrier(world)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    # Every rank tokenizes its share of the batches; rank 0 joins them and publishes the cache.
    cache = build_token_cache(
        args.texts,
        tokenizer,
        args.cache,
        max_length=MAX_LENGTH,
        text_field=args.text_field,
        distributed=world > 1,
    )
    if args.mix is None:
        return tokenizer, cache, None
    second = build_token_cache(
        args.mix,
        tokenizer,
        args.cache.with_name(args.cache.name + "-mix"),
        max_length=MAX_LENGTH,
        text_field=args.text_field,
        distributed=world > 1,
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


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint whole


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
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    args.workdir.mkdir(parents=True, exist_ok=True)
    tokenizer, cache, mixture = prepare_data(args, rank, world)
    if mixture is None:
        lengths = cache.lengths
    else:  # every source's lengths, in the sources' order
        lengths = np.concatenate([d.lengths for d in cache.datasets])
    sampler = LengthBucketSampler(
        lengths, max_tokens=args.max_tokens, pad_to_multiple_of=8, seed=0, mixture=mixture
    )
    loader = LoaderMonitor(
        make_loader(cache, batch_sampler=sampler, collate_fn=PadCollate(tokenizer.pad_token_id))
    )
    model = build_model(len(tokenizer), args.smoke).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    checkpoint = args.workdir / "checkpoint.pt"
    start_epoch = 0
    step = 0
    loader_state = None
    if checkpoint.exists():  # resume: model, optimiser, and the loader's place in the epoch
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = saved["epoch"]
        step = saved["step"]
        loader_state = saved["loader"]
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    generator = torch.Generator(device).manual_seed(rank)
    log = None
    if args.log_samples:
        log = open(args.workdir / f"samples-rank{rank}.txt", "a")  # noqa: SIM115
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        if loader_state is not None:
            loader.loader.load_state_dict(loader_state)
            loader_state = None
        start = time.perf_counter()
        loss = None
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            ids, attention, labels = mask_tokens(batch, tokenizer.mask_token_id, generator)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = ddp(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
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
            if step % args.checkpoint_every == 0 and rank == 0:
                save_checkpoint(
                    checkpoint,
                    model=model.state_dict(),
                    optimizer=optimizer.state_dict(),
                    epoch=epoch,
                    step=step,
                    loader=loader.loader.state_dict(),
                )
            if args.stop_after is not None and step >= args.stop_after:
                barrier(world)
                os._exit(0)  # a simulated crash: no clean-up, as a killed job
        if rank == 0:
            print_epoch(epoch, time.perf_counter() - start, loss, loader.summary())
            save_checkpoint(
                checkpoint,
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                epoch=epoch + 1,
                step=step,
                loader=None,
            )
    if rank == 0:
        print(loader.report())
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
