"""The write rows of `recipes bench shards`: an image folder written as shards by
`write_shards`, by webdataset's `ShardWriter` and by LitData's `optimize`, one process each.

Use when: reading how `recipes bench shards`' first table is measured (`write_rows`).
Cost: `repeat` writes of ours and webdataset's, in turns, then one `litdata.optimize`; the
last turn's shards stay in `out` for the read rows.
Adapt here: `repeat`, the writers' arguments.
Trade-off: the peers are measured only when installed; their rows are left out otherwise, and
the notes say so.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

from recipes.commands.shards_cmd import image_folder_samples
from recipes.common import write_shards


def have(name: str) -> bool:
    """Whether the peer `name` is installed (its rows are measured only then)."""
    return importlib.util.find_spec(name) is not None


def _turn_folder(out: Path, name: str, turn: int, last: bool) -> Path:
    """The folder a turn writes to: `out/name` for the last one (kept), a hidden one before."""
    if last:
        return out / name
    return out / f".{name}-{turn}"


def write_rows(
    root: Path, out: Path, shard_bytes: int, repeat: int = 3
) -> tuple[list[tuple[str, float, str]], list[str]]:
    """`(name, samples/s, output)` for each writer, one process each, and notes. Ours and
    webdataset's are the best of `repeat` writes, taken in turns: a write lasts a fraction of a
    second, and how long an fsync waits depends on what else the disk is flushing."""
    samples = image_folder_samples(root)
    n = len(samples)
    rows = []
    notes = []
    best = {"ours": 0.0, "wds": 0.0}
    wds = None
    if have("webdataset"):
        import webdataset as wds
    else:
        notes.append("webdataset rows left out: pip install webdataset")
    for turn in range(repeat):
        last = turn == repeat - 1  # the last turn's shards stay, for the read rows
        target = _turn_folder(out, "ours", turn, last)
        start = time.perf_counter()
        write_shards(samples, target, shard_bytes=shard_bytes, progress=False)
        best["ours"] = max(best["ours"], n / (time.perf_counter() - start))
        if wds is not None:
            folder = _turn_folder(out, "wds", turn, last)
            folder.mkdir()
            start = time.perf_counter()
            with wds.ShardWriter(
                str(folder / "shard-%06d.tar"), maxsize=shard_bytes, verbose=0
            ) as sink:
                for sample in samples:
                    sink.write(sample)
            best["wds"] = max(best["wds"], n / (time.perf_counter() - start))
        if not last:
            for folder in (out / f".ours-{turn}", out / f".wds-{turn}"):
                shutil.rmtree(folder, ignore_errors=True)
    rows.append(("recipes write_shards (tar + index)", best["ours"], "ours"))
    if wds is not None:
        rows.append(("webdataset ShardWriter (tar)", best["wds"], "wds"))
    if have("litdata"):
        rows.append(_litdata_row(samples, out, shard_bytes))
    else:
        notes.append("LitData rows left out: pip install litdata")
    return rows, notes


def _litdata_row(samples, out: Path, shard_bytes: int) -> tuple[str, float, str]:
    """LitData's `optimize` of the same samples (one worker) into `out/lit`."""
    import litdata

    n = len(samples)
    start = time.perf_counter()
    litdata.optimize(
        fn=LitSample(samples),
        inputs=list(range(n)),
        output_dir=str(out / "lit"),
        chunk_bytes=shard_bytes,
        num_workers=1,
        verbose=False,
        start_method="fork",
    )
    return "LitData optimize (1 worker)", n / (time.perf_counter() - start), "lit"


class LitSample:
    """`optimize`'s function: index to the sample's encoded bytes and label (no decoding)."""

    def __init__(self, samples):
        self.samples = samples

    def __call__(self, index):
        sample = self.samples[index]
        field = next(k for k in sample if k not in ("__key__", "cls"))
        return {"key": sample["__key__"], "data": sample[field], "cls": sample["cls"]}
