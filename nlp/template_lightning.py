"""Masked-language-model training with Lightning and the recipes: a complete script to copy and
adapt.

    recipes template nlp --framework lightning > train.py
    python train.py --texts corpus.jsonl --tokenizer ./my_tokenizer --cache /nvme/tokens
    torchrun --nproc_per_node=8 train.py --texts corpus.jsonl --tokenizer ./my_tokenizer --cache
    /nvme/tokens python train.py --smoke            # a generated corpus, a tokenizer trained on the
    fly, a tiny BERT

What to change for your data (lines marked ADAPT):
  - `build_model`: your network (a BERT masked LM from a `BertConfig`, no downloaded weights).
  - `--texts` (.txt, one sample per line, or .jsonl with `--text-field`), `--tokenizer` (a
    saved tokenizer folder), `--cache` (the token cache's folder), `MAX_LENGTH`.
  - `--max-tokens`: padded tokens per batch per rank; the optimiser and its OneCycleLR schedule.
What Lightning gets from the recipes (docs/frameworks/lightning.md):
  - `LoaderDataModule`: its `train_loader()` builds the `make_loader` loader over
    `LengthBucketSampler` batches, and Lightning's checkpoints (`checkpoints/checkpoint.ckpt`,
    every `--checkpoint-every` steps) resume it at the first batch not trained, in the same
    order, on every rank; also with OneCycleLR, which reads `trainer.estimated_stepping_batches`
    (there Lightning alone loses the loader's place: Lightning #20550). Run the same command
    again to resume.
  - `use_distributed_sampler=False`: `LengthBucketSampler` deals the batches over the ranks
    itself (Lightning cannot re-create it around a `DistributedSampler`); `LoaderDataModule`
    calls its `set_epoch` at each epoch, which Lightning does not for a batch sampler.
  - The rest is the plain template's (`recipes template nlp`, which also mixes two corpora):
    the token cache (read by threads), length-bucketed batches under a token budget, `PadCollate`.
Copy with: the installed recipes package.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from recipes.common import LengthBucketSampler, make_loader
from recipes.common.frameworks.lightning_glue import LoaderDataModule
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
    parser.add_argument("--lr", type=float, default=1e-4, help="OneCycleLR's peak")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1000, help="steps between checkpoints"
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


class Texts(LoaderDataModule):
    """The tokenizer, the token cache (tokenized once, split over the ranks) and the loader."""

    def __init__(self, args):
        super().__init__()
        self.args = args

    def prepare_data(self) -> None:  # once per node, before setup
        args = self.args
        if args.smoke and not args.tokenizer.exists():
            texts = make_text_corpus(240, seed=0)
            Path(args.texts).write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n")
            train_tokenizer(texts, vocab_size=400).save_pretrained(args.tokenizer)

    def setup(self, stage: str) -> None:
        from transformers import AutoTokenizer

        super().setup(stage)
        args = self.args
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        # every rank tokenizes its share of the batches; rank 0 joins them and publishes the cache
        self.dataset = build_token_cache(
            args.texts,
            self.tokenizer,
            args.cache,
            max_length=MAX_LENGTH,
            text_field=args.text_field,
            distributed=self.trainer.world_size > 1,
        )

    def train_loader(self):
        # the ranks come from torch.distributed: each rank gets its share of the bucketed batches
        sampler = LengthBucketSampler(
            self.dataset.lengths, max_tokens=self.args.max_tokens, pad_to_multiple_of=8, seed=0
        )
        return make_loader(
            self.dataset, batch_sampler=sampler, collate_fn=PadCollate(self.tokenizer.pad_token_id)
        )


def mask_tokens(batch, mask_id: int, generator: torch.Generator):
    """BERT's masking: 15% of the real tokens become [MASK]; only those are predicted."""
    ids = batch["input_ids"]
    attention = batch["attention_mask"]
    chosen = (
        torch.rand(ids.shape, generator=generator, device=ids.device) < 0.15
    ) & attention.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return torch.where(chosen, torch.full_like(ids, mask_id), ids), attention, labels


class MaskedLM(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.log_file = None
        self.started = 0.0
        self.loss = None

    def setup(self, stage: str) -> None:  # after the DataModule's: the tokenizer is known
        self.tokenizer = self.trainer.datamodule.tokenizer
        self.model = build_model(len(self.tokenizer), self.args.smoke)
        self.generator = torch.Generator(self.device).manual_seed(self.global_rank)
        if self.args.log_samples:
            self.log_file = open(self.args.workdir / f"samples-rank{self.global_rank}.txt", "a")  # noqa: SIM115

    def on_train_start(self) -> None:  # a resumed epoch has no on_train_epoch_start
        self.started = time.perf_counter()

    def on_train_epoch_start(self) -> None:
        self.started = time.perf_counter()

    def training_step(self, batch, index):
        ids, attention, labels = mask_tokens(batch, self.tokenizer.mask_token_id, self.generator)
        loss = self.model(input_ids=ids, attention_mask=attention, labels=labels).loss
        self.loss = loss.detach()
        if self.log_file is not None:  # one line per step: a hash of each sample's tokens
            self.log_file.write(
                " ".join(
                    hashlib.sha1(row[:n].cpu().numpy().tobytes()).hexdigest()[:16]
                    for row, n in zip(batch["input_ids"], batch["lengths"].tolist(), strict=True)
                )
                + "\n"
            )
            self.log_file.flush()
        return loss

    def on_train_batch_end(
        self, outputs, batch, index
    ) -> None:  # after the checkpoint callback saved
        if self.args.stop_after is not None and self.trainer.global_step >= self.args.stop_after:
            self.trainer.strategy.barrier("stop")
            os._exit(0)  # a simulated crash: no clean-up, as a killed job

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:  # a resume at an epoch's end has no batch left: no loss
            loss = "-"
            if self.loss is not None:
                loss = f"{self.loss.item():.3f}"
            print(
                f"epoch {self.current_epoch}: {time.perf_counter() - self.started:.1f} s, loss "
                f"{loss}",
                flush=True,
            )

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.args.lr)
        # ADAPT: the schedule; reading estimated_stepping_batches sets the training loader up now
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.args.lr, total_steps=int(steps)
        )
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.texts = str(args.workdir / "corpus.txt")
        args.tokenizer = args.workdir / "tokenizer"
        args.cache = args.workdir / "tokens"
    args.workdir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    devices = int(
        os.environ.get("LOCAL_WORLD_SIZE", 1)
    )  # torchrun's processes on this node (Lightning joins them)
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // devices
    checkpoints = ModelCheckpoint(
        dirpath=args.workdir / "checkpoints",
        filename="checkpoint",
        every_n_train_steps=args.checkpoint_every,
        enable_version_counter=False,
    )
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="auto",
        devices=devices,
        num_nodes=nodes,
        strategy="ddp" if devices * nodes > 1 else "auto",
        callbacks=[checkpoints],
        use_distributed_sampler=False,  # LengthBucketSampler splits the batches over the ranks
        precision="bf16-mixed" if torch.cuda.is_available() else "32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = args.workdir / "checkpoints" / "checkpoint.ckpt"
    if not resume.exists():  # a first run: nothing to resume
        resume = None
    started = time.perf_counter()
    trainer.fit(MaskedLM(args), datamodule=Texts(args), ckpt_path=resume)
    if trainer.global_rank == 0:
        print(
            f"trained to epoch {trainer.current_epoch} in {time.perf_counter() - started:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
