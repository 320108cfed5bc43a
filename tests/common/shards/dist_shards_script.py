"""Run under torchrun (2 gloo processes): write an image folder (tar) and a corpus (Parquet) as
shards split over the ranks, locally and to S3 (moto, endpoint in argv), then read both S3 sets
back through PrefetchCache with 2 DataLoader workers per rank; each rank records what it read."""

import datetime
import hashlib
import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from recipes.commands.shards_cmd import image_folder_samples
from recipes.common import PrefetchCache
from recipes.common.shards.shard_writer import write_shards


def main(work: str, endpoint: str) -> None:
    work = Path(work)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    images = image_folder_samples(work / "tree")
    texts = [
        {"__key__": f"t{i:05d}", "txt": line}
        for i, line in enumerate((work / "texts.txt").read_text().splitlines())
    ]
    write_shards(images, work / "split_tar", shard_bytes=60_000, distributed=True, progress=False)
    sets = {
        "tar": write_shards(
            images,
            "s3://bucket/tar",
            shard_bytes=60_000,
            storage_options=options,
            distributed=True,
            progress=False,
        ),
        "parquet": write_shards(
            texts,
            "s3://bucket/text",
            format="parquet",
            shard_bytes=3_000,
            storage_options=options,
            distributed=True,
            progress=False,
        ),
    }
    seen = {}
    for name, shards in sets.items():
        cache = PrefetchCache(
            work / f"cache-{rank}-{name}", max_bytes=2**30, storage_options=options
        )
        ds = shards.dataset(cache=cache, shuffle=True, seed=5)
        rows = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            for sample in DataLoader(ds, batch_size=None, num_workers=2):
                if name == "tar":
                    rows.append(
                        [
                            epoch,
                            sample["__key__"],
                            hashlib.sha256(sample["jpg"]).hexdigest(),
                            sample["cls"],
                        ]
                    )
                else:
                    rows.append([epoch, sample["__key__"], sample["txt"]])
        seen[name] = rows
    (work / f"read-{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
