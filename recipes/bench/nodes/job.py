"""One simulated node's training job (`recipes.testing_nodes` starts it under torchrun on each
node; `tests/test_nodes.py` checks what it wrote, `recipes bench nodes` times it), as a user
writes it for N nodes with local disks:
caches built into a relative folder (this node's own disk), `make_loader` splitting the ranks
by itself, rank 0's loader state saved as the checkpoint.

    python recipes/bench/nodes/job.py SPEC_JSON

SPEC: `kind` ("images": an eval set's decoded cache; "shards": a ShardSet on moto's S3 through a
node-local PrefetchCache; "mixture": a MixtureSampler over the image cache and a token cache),
`data` (read-only inputs), `shared` (what the nodes share: the checkpoint and the reports),
`run` (the report folder's name), `epochs`, `batch`, `stop_after` and `stop_epoch` (rank 0
saves its loader state after this many steps of that epoch, then the job waits to lose a
node), `resume` (load the checkpoint first), `url` and `storage_options` (the shards on S3), `alone`
(every rank builds the caches by itself, `distributed=False`: what recipes 0.1 did under torchrun),
`images` (the photo folder's name in `data`, "photos" by default).

Each rank writes `shared/<run>/rank<R>.json`: what it received, per epoch and step (each sample's
identity: an eval image's pixel hash, a shard sample's key, a mixture source's name and index).
Work is counted in this node's `counts/` folder, one line per unit and a file per phase ("build"
or "epoch"), run and process (workers included): `read.<phase>` (an image file read: every decode
reads one), `tokenize.<phase>` (texts), `download.<phase>` (a PrefetchCache download, by URL)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import recipes.nlp.token_cache as token_cache
from recipes.common import MixtureSampler, MixtureSources, ShardSet, make_loader
from recipes.common.remote.prefetch_cache import PrefetchCache
from recipes.nlp import build_token_cache
from recipes.vision import build_image_cache
from recipes.vision.image_folder import ImageFolderFast

PHASE = ["build", "run"]  # the phase, the run's name


def count(what: str, line: str = "1") -> None:
    with open(Path("counts") / f"{what}.{PHASE[0]}.{PHASE[1]}.{os.getpid()}", "a") as f:
        f.write(line + "\n")


def instrument() -> None:
    """Counts image file reads, texts tokenized and downloads, in this process and its workers."""

    read = ImageFolderFast._read
    download = PrefetchCache._download
    encoder = token_cache.batch_encoder

    def counted_read(self, index):
        count("read")
        return read(self, index)

    def counted_download(self, url, final, sha256):
        count("download", url)
        return download(self, url, final, sha256)

    def counted_encoder(*args, **kwargs):
        encode = encoder(*args, **kwargs)

        def call(texts):
            count("tokenize", str(len(texts)))
            return encode(texts)

        return call

    ImageFolderFast._read = counted_read
    PrefetchCache._download = counted_download
    token_cache.batch_encoder = counted_encoder


def image_hash(image: torch.Tensor) -> str:
    return hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def images(spec: dict):
    dataset = ImageFolderFast(
        Path(spec["data"]) / spec.get("images", "photos"), size=64, train=False
    )
    # every rank calls: split over all of them, each node's folder ending with the whole cache;
    # a node alone builds its own
    distributed = None
    if spec.get("alone"):
        distributed = False
    build_image_cache(dataset, "cache", num_workers=0, progress=False, distributed=distributed)
    return dataset


class Keyed:
    """A mixture source whose items say where they come from: `"name:index"` (the item read)."""

    def __init__(self, dataset, name: str):
        self.dataset = dataset
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> str:
        self.dataset[index]
        return f"{self.name}:{index}"


def build_loader(spec: dict):
    batch = spec["batch"]
    if spec["kind"] == "images":
        dataset = images(spec)
        return make_loader(dataset, batch_size=batch, shuffle=True), lambda b: [
            image_hash(x) for x in b[0]
        ]
    if spec["kind"] == "shards":
        shards = ShardSet.open(spec["url"], storage_options=spec["storage_options"])
        cache = PrefetchCache(
            "shard-cache", max_bytes=256 * 2**20, storage_options=spec["storage_options"]
        )  # this node's disk
        dataset = shards.dataset(cache=cache, decode=False)
        return make_loader(dataset, batch_size=batch, num_workers=1, collate_fn=_keys), lambda b: b
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        Path(spec["data"]) / "tokenizer", local_files_only=True
    )
    tokens = build_token_cache(
        Path(spec["data"]) / "texts.txt", tokenizer, "cache/tokens", batch_size=16, progress=False
    )
    pictures = images(spec)
    sources = MixtureSources([Keyed(pictures, "images"), Keyed(tokens, "texts")])
    mixture = MixtureSampler(
        {"images": len(pictures), "texts": len(tokens)}, {"images": 0.5, "texts": 0.5}, seed=2
    )
    return make_loader(
        sources, batch_size=batch, sampler=mixture, num_workers=0, collate_fn=list
    ), lambda b: b


def _keys(samples):
    return [s["__key__"] for s in samples]


def main(spec: dict) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    world = dist.get_world_size()
    Path("counts").mkdir(exist_ok=True)
    PHASE[1] = spec["run"]
    instrument()
    report = Path(spec["shared"]) / spec["run"]
    report.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    loader, identities = build_loader(spec)
    built = time.perf_counter() - started
    checkpoint = Path(spec["shared"]) / "checkpoint.json"
    first_batch = None
    if spec.get("resume"):
        loader.load_state_dict(json.loads(checkpoint.read_text()))
    PHASE[0] = "epoch"
    received = []
    start_epoch = int(loader.state_dict()["epoch"])
    holder = (
        loader.dataset
        if isinstance(loader.dataset, torch.utils.data.IterableDataset)
        else loader.sampler
    )
    for epoch in range(start_epoch, spec["epochs"]):
        if (
            spec["kind"] != "images"
        ):  # images: make_loader's sampler moves on by itself (the README's loop)
            holder.set_epoch(epoch)
        steps = []
        began = time.perf_counter()
        for step, batch in enumerate(loader):
            if first_batch is None:
                first_batch = time.perf_counter() - began
            steps.append(identities(batch))
            done = torch.tensor([1.0])
            dist.all_reduce(
                done
            )  # a collective per step, as DDP: unequal step counts would hang here
            if (
                spec.get("stop_after") == step + 1
                and epoch == spec.get("stop_epoch", 0)
                and not spec.get("resume")
            ):
                if rank == 0:
                    temp = checkpoint.with_suffix(".tmp")
                    temp.write_text(json.dumps(loader.state_dict()))
                    os.replace(temp, checkpoint)
                received.append({"epoch": epoch, "steps": steps})
                _write(report, rank, received, built, first_batch, world)
                dist.barrier()  # the checkpoint is in place: now a node is lost
                while True:  # the test kills a node; the survivors' next collective fails
                    dist.all_reduce(torch.tensor([1.0]))
                    time.sleep(0.05)
        received.append({"epoch": epoch, "steps": steps})
    _write(report, rank, received, built, first_batch, world)
    dist.barrier()
    dist.destroy_process_group()


def _write(report: Path, rank: int, received: list, built: float, first_batch, world: int) -> None:
    record = {
        "rank": rank,
        "world": world,
        "node": int(os.environ.get("GROUP_RANK", 0)),
        "received": received,
        "build_s": built,
        "first_batch_s": first_batch,
        "cache_bytes": int(sum(p.stat().st_size for p in Path("cache").rglob("*") if p.is_file()))
        if Path("cache").exists()
        else 0,
    }
    (report / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
