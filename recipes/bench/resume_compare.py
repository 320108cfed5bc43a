"""Resume exactness, `make_loader` vs torchdata's `StatefulDataLoader` (issue #19).

Use when: deciding which loader to trust with a checkpoint: for each situation (mid-epoch in
a later epoch, persistent workers, the state saved at an epoch's end, a `DistributedSampler`,
another worker count, a user's seeded sampler) it saves a state, rebuilds the loader from it
in the same process and counts, per epoch, the samples repeated and lost against an
uninterrupted run of the same seed, and whether the order matched.
Cost: 8 situations x 2 loaders, each an interrupted run and a reference run of up to 4 epochs
of 12 batches with 2 forked workers: about 16 s on 2 cores (7 s for the recipes column alone).
Adapt here: `SITUATIONS` (the scenarios) and `_build` (how each loader is constructed).
Trade-off: scaffolding, not library code: torchdata is imported only here and never becomes a
dependency (`pip install --no-deps "torchdata==0.11.*"` to fill its column). The states
travel through JSON where that round trip is lossless, else through `copy.deepcopy` (noted).

Known anchors: pytorch/data#1437 (a state restored at an epoch's end can drop an epoch),
huggingface/datasets#7447 (persistent workers shorten the epochs after a resume), torchdata's
`TestNumWorkersMismatch` (a resume needs the same `num_workers`).
"""

from __future__ import annotations

import copy
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.utils.data import DistributedSampler, RandomSampler

from recipes.common.loading.loader import make_loader

N = 48
BATCH = 4
TAKEN = 5
SEED = 0
LOADERS = ("recipes", "torchdata")
NAMES = {"recipes": "recipes make_loader", "torchdata": "torchdata StatefulDataLoader"}


@dataclass(frozen=True)
class Situation:
    """Where the state is saved: in `epoch`, after `taken` batches (`"end"`: after the last
    batch, before StopIteration; `"ended"`: after the loop over the epoch finished)."""

    title: str
    epoch: int
    taken: int | Literal["end", "ended"]
    persistent: bool = False
    sampler: Literal["shuffle", "distributed", "user"] = "shuffle"
    workers_after: int = 2


SITUATIONS = {
    "a": Situation("mid-epoch 0, non-persistent", 0, TAKEN),
    "b": Situation("mid-epoch 1, persistent", 1, TAKEN, persistent=True),
    "c": Situation("mid-epoch 2, persistent", 2, TAKEN, persistent=True),
    "d": Situation("saved after the loop over epoch 0 ended", 0, "ended"),
    "e": Situation("saved after the last batch, before StopIteration", 0, "end"),
    "f": Situation(
        "DistributedSampler(2 ranks, rank 0) + set_epoch, saved after epoch 0",
        0,
        "ended",
        sampler="distributed",
    ),
    "g": Situation("mid-epoch 0, resumed with 0 workers (saved with 2)", 0, TAKEN, workers_after=0),
    "h": Situation(
        "user RandomSampler(generator=g), mid-epoch 1, persistent",
        1,
        TAKEN,
        persistent=True,
        sampler="user",
    ),
}


@dataclass
class Outcome:
    """One loader in one situation, summed over the epochs the run went through."""

    repeated: int = 0
    lost: int = 0
    order: bool = True
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def cell(self) -> str:
        if self.error is not None:
            return "error"
        order = "no"
        if self.order:
            order = "yes"
        return f"{self.repeated}/{self.lost}/{order}"


def torchdata_available() -> bool:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means: no torchdata column
        return False
    return True


def _build(loader: str, situation: Situation, workers: int):
    """The loader as a training script builds it, from the same seeds every time."""
    dataset = list(range(N))
    kwargs: dict = {"batch_size": BATCH, "num_workers": workers}
    if workers:
        kwargs["persistent_workers"] = situation.persistent
    if situation.sampler == "distributed":
        kwargs["sampler"] = DistributedSampler(dataset, num_replicas=2, rank=0)
    elif situation.sampler == "user":
        kwargs["sampler"] = RandomSampler(dataset, generator=torch.Generator().manual_seed(7))
    else:
        kwargs["shuffle"] = True
    if loader == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, generator=torch.Generator().manual_seed(SEED), **kwargs)

    torch.manual_seed(SEED)
    return make_loader(dataset, **kwargs)


def _keys(batches) -> list[tuple[int, ...]]:
    return [tuple(torch.as_tensor(b).flatten().tolist()) for b in batches]


def _epoch(loader, situation: Situation, epoch: int) -> list[tuple[int, ...]]:
    if situation.sampler == "distributed":
        loader.sampler.set_epoch(epoch)
    return _keys(loader)


def _reference(loader: str, situation: Situation, epochs: int) -> list[list[tuple[int, ...]]]:
    """The uninterrupted run: `epochs` passes over one loader built as the saving run's."""
    reference = _build(loader, situation, 2)
    return [_epoch(reference, situation, e) for e in range(epochs)]


def _round_trip(state: dict) -> tuple[dict, str | None]:
    """The state as a checkpoint holds it: plain JSON when that round trip loses nothing."""
    try:
        back = json.loads(json.dumps(state))
    except (TypeError, ValueError) as error:
        return copy.deepcopy(state), f"not JSON ({error}): deep-copied"
    if back != state:
        return copy.deepcopy(
            state
        ), "not JSON (a round trip changes it: tuples or non-string keys): deep-copied"
    return back, None


def _interrupted(
    loader: str, situation: Situation, notes: list[str]
) -> list[list[tuple[int, ...]]]:
    """The run that saves, rebuilds and resumes: the batches each pass of the loop received
    (the resumed epoch, then one more, so that a shortened or skipped next epoch shows)."""
    first = _build(loader, situation, 2)
    received = [_epoch(first, situation, e) for e in range(situation.epoch)]
    prefix: list[tuple[int, ...]] = []
    if situation.taken == "ended":
        received.append(_epoch(first, situation, situation.epoch))
    else:
        if situation.sampler == "distributed":
            first.sampler.set_epoch(situation.epoch)
        iterator = iter(first)
        count = len(first) if situation.taken == "end" else situation.taken
        prefix = _keys(next(iterator) for _ in range(count))
    state, note = _round_trip(first.state_dict())
    if note:
        notes.append(note)
    del first  # its workers stop (a persistent iterator may linger until collected)
    resumed = _build(loader, situation, situation.workers_after)
    resumed.load_state_dict(state)  # a training script loads, then sets the epoch, then loops
    epoch = len(received)
    received.append(prefix + _epoch(resumed, situation, epoch))
    received.append(_epoch(resumed, situation, epoch + 1))
    return received


def _compare(received, reference, outcome: Outcome) -> None:
    """Counts per epoch (a sample in the wrong epoch is one repeated there, one lost in its own)."""
    for epoch, (got, want) in enumerate(zip(received, reference, strict=True)):
        have = Counter(i for batch in got for i in batch)
        need = Counter(i for batch in want for i in batch)
        repeated = sum((have - need).values())
        lost = sum((need - have).values())
        outcome.repeated += repeated
        outcome.lost += lost
        if got != want:
            outcome.order = False
            note = (
                f"epoch {epoch}: {len(got)} of {len(want)} batches, {repeated} repeated, "
                f"{lost} lost"
            )
            if not (repeated or lost):  # the same samples, in another order
                note += ", other order"
            outcome.notes.append(note)


def _describe(error: BaseException) -> str:
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} `{(frame.line or '').strip()}`"
    text = str(error).strip()
    described = type(error).__name__
    if text:  # its message's first line, cut at 200 characters
        described += ": " + text.splitlines()[0][:200]
    return f"{described} (at {where})"


def run_situation(loader: str, key: str) -> Outcome:
    """One loader ("recipes" or "torchdata") in one situation (a key of `SITUATIONS`)."""
    situation = SITUATIONS[key]
    outcome = Outcome()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            received = _interrupted(loader, situation, outcome.notes)
            _compare(received, _reference(loader, situation, len(received)), outcome)
        except Exception as error:  # noqa: BLE001 - a loader that refuses a situation is a result
            outcome.error = _describe(error)
    for message in dict.fromkeys(
        str(w.message).strip().splitlines()[0][:160]
        for w in caught
        if not issubclass(w.category, DeprecationWarning)
    ):
        outcome.notes.append(f"warning: {message}")
    return outcome


def compare_resume(loaders=None, situations=None) -> dict[tuple[str, str], Outcome]:
    """Runs every (loader, situation): `loaders` defaults to recipes, plus torchdata when it
    imports; `situations` to every key of `SITUATIONS`.

    Raises:
        ImportError: "torchdata" asked for but not importable.
    """
    if loaders is None:
        loaders = [name for name in LOADERS if name == "recipes" or torchdata_available()]
    if "torchdata" in loaders and not torchdata_available():
        raise ImportError(
            'The torchdata column needs torchdata: pip install --no-deps "torchdata==0.11.*"'
        )
    return {
        (loader, key): run_situation(loader, key)
        for key in (situations or SITUATIONS)
        for loader in loaders
    }


def format_table(results: dict[tuple[str, str], Outcome]) -> str:
    """The markdown table (cells: repeated/lost/order), then a note per cell that needs one."""
    loaders = list(dict.fromkeys(loader for loader, _ in results))
    keys = list(dict.fromkeys(key for _, key in results))
    lines = [
        "| situation | " + " | ".join(f"{name}: repeated/lost/order" for name in loaders) + " |",
        "|---|" + "---|" * len(loaders),
    ]
    for key in keys:
        cells = " | ".join(results[loader, key].cell() for loader in loaders)
        lines.append(f"| ({key}) {SITUATIONS[key].title} | {cells} |")
    where: dict[tuple[str, str], list[str]] = {}  # (loader, note) -> situations, in order
    for key in keys:
        for loader in loaders:
            outcome = results[loader, key]
            texts = list(outcome.notes)
            if outcome.error:
                texts.insert(0, outcome.error)
            for text in texts:
                where.setdefault((loader, text), []).append(key)
    notes = [f"- {loader} ({', '.join(found)}): {text}" for (loader, text), found in where.items()]
    if notes:  # after a blank line
        lines += ["", *notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`python -m recipes.bench.resume_compare [--situations a,b,...]`: prints the table."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--situations", default=",".join(SITUATIONS), help="keys of SITUATIONS, comma-separated"
    )
    keys = [key.strip() for key in parser.parse_args(argv).situations.split(",") if key.strip()]
    unknown = [key for key in keys if key not in SITUATIONS]
    if unknown:
        parser.error(f"unknown situations {unknown}; choose from {', '.join(SITUATIONS)}")
    have_torchdata = torchdata_available()
    results = compare_resume(situations=keys)
    print(f"torch {torch.__version__}; ", end="")
    if have_torchdata:
        import torchdata

        print(f"torchdata {torchdata.__version__}")
    else:
        print(
            "torchdata is not installed: recipes column only (pip install --no-deps "
            '"torchdata==0.11.*")'
        )
    print(
        f"map-style dataset of {N} ints, batch_size {BATCH}, 2 workers; counted per epoch against "
        "an uninterrupted run of the same seed, over the epochs up to the one after the resume\n"
    )
    print(format_table(results))


if __name__ == "__main__":
    main()
