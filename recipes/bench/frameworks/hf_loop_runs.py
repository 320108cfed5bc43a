"""The measurements behind `recipes bench hf` (`hf_loops.py`): the time to the first batch
after a resume (ours through accelerate, accelerate's `skip_first_batches`, the Trainer's both
ways) and one epoch of the same loader in a plain loop, accelerate's and the Trainer's.

Use when: reading how `recipes bench hf`'s two tables are measured (`resume_rows`,
`throughput_rows`, `glue_cost`).
Cost: imports transformers (through `trainer_runs.py`) and accelerate's glue at its top, so the
command imports it only when it runs; the tables' costs are in `hf_loops.py`'s header.
Adapt here: `LOOPS` (the throughput rows), the kinds of items in `throughput_rows`.
Trade-off: accelerate's rows time the loader alone (`load_state_dict` + `iter` + the first
batch), the Trainer's rows its whole resume.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from recipes.bench.frameworks.costly_items import (
    CostlyItems,
    Tiny,
    costly_dataset,
    our_loader,
    shuffle_of,
    state_after,
)
from recipes.bench.frameworks.trainer_runs import (
    trainer_checkpoint,
    trainer_epoch,
    trainer_first_after,
)
from recipes.common import make_loader
from recipes.common.frameworks.accelerate_glue import AcceleratedLoader, prepare_loader


# ---- the time to the first batch after a resume -----------------------------------------
def _time_first(begin) -> float:
    """Seconds from calling `begin()` (which returns an iterator) to its first item."""
    start = time.perf_counter()
    iterator = begin()
    next(iterator)
    took = time.perf_counter() - start
    del iterator  # its workers end now
    return took


def _first_after_ours(accelerator, kind, n, state, args) -> float:
    loader = our_loader(kind, n, args.item_us, args)
    wrapped = AcceleratedLoader(loader, accelerator=accelerator)

    def begin():
        wrapped.load_state_dict(state)
        return iter(wrapped)

    took = _time_first(begin)
    loader.close()
    return took


def _first_after_skip(accelerator, kind, n, skip, args) -> float:
    torch.manual_seed(0)
    prepared = accelerator.prepare_data_loader(
        DataLoader(
            costly_dataset(kind, n, args.item_us),
            batch_size=args.batch_size,
            num_workers=args.workers,
            **shuffle_of(kind),
        )
    )
    return _time_first(lambda: iter(accelerator.skip_first_batches(prepared, skip)))


def resume_rows(accelerator, args, folder: Path) -> list[list[str]]:
    n = args.batches * args.batch_size
    positions = [max(1, round(float(p) * args.batches)) for p in args.positions.split(",")]
    rows = []
    for kind in ("map", "iterable"):
        bases = {
            ours: trainer_checkpoint(folder / f"{kind}-{ours}", kind, n, args, ours)
            for ours in (True, False)
        }
        for position in positions:
            state = state_after(kind, n, position, args)
            cells = [
                _first_after_ours(accelerator, kind, n, state, args),
                _first_after_skip(accelerator, kind, n, position, args),
                trainer_first_after(bases[True], position, kind, n, args, ours=True),
                trainer_first_after(bases[False], position, kind, n, args, ours=False),
            ]
            rows.append([kind, f"{position:,} of {args.batches:,}", *(f"{c:.3f}" for c in cells)])
    return rows


# ---- throughput: the same loader in a plain loop, accelerate's and the Trainer's ----------
def _step_epoch(batches, model, optimizer, backward) -> float:
    start = time.perf_counter()
    for batch in batches:
        backward(model(**batch)["loss"])
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def _accelerate_epoch(accelerator, loader, name: str, glue: bool = True) -> float:
    """An epoch of accelerate's step over `loader`, through `prepare_loader` (or, `glue=False`,
    iterated as it is: on CPU the batches are where the model is)."""
    model = Tiny()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    prepared = loader
    if glue:
        prepared = prepare_loader(accelerator, loader, name=name)
    return _step_epoch(prepared, model, optimizer, accelerator.backward)


def _loop_epoch(
    loop: str, accelerator, items: CostlyItems, workers: int, args, folder: Path, tag: str
) -> float:
    """Seconds of one epoch of `loop` (a key of `LOOPS`) over a fresh loader."""
    torch.manual_seed(0)
    loader = make_loader(
        items, batch_size=args.batch_size, shuffle=True, num_workers=workers, path="workers"
    )
    if loop == "plain":
        model = Tiny()
        took = _step_epoch(
            loader, model, torch.optim.SGD(model.parameters(), lr=0.01), torch.Tensor.backward
        )
    elif loop.startswith("accelerate"):
        took = _accelerate_epoch(accelerator, loader, f"loop-{tag}", glue=loop == "accelerate")
    else:
        took = trainer_epoch(loader, folder / f"loop-{tag}")
    loader.close()
    return took


LOOPS = {
    "plain": "plain loop",
    "accelerate": "accelerate (`prepare_loader`)",
    "accelerate-bare": "accelerate's step, the loader iterated bare (no glue)",
    "trainer": "transformers Trainer (`LoaderTrainerMixin`)",
}


def throughput_rows(accelerator, args, folder: Path) -> list[list[str]]:
    """Per loop and kind of loader (items that wait, as on storage; items that compute): the
    best epoch's samples/s of `args.repeats`, taken in turns, against the plain loop's."""
    n = args.loop_batches * args.batch_size
    # (items wait, cost per item, workers); "instant": the loop's own cost per step, items made
    # in-process
    kinds = {
        "waits (I/O-bound)": (True, args.loop_item_us, args.workers),
        "computes (CPU-bound)": (False, args.loop_item_us, args.workers),
        "instant": (False, 0.0, 0),
    }
    best = {(kind, loop): float("inf") for kind in kinds for loop in LOOPS}
    for loop in LOOPS:  # a first epoch of each, not counted: first calls, allocator, page cache
        _loop_epoch(
            loop,
            accelerator,
            CostlyItems(n // 4, args.loop_item_us),
            args.workers,
            args,
            folder,
            "warm-up",
        )
    # in turns, so that a slow spell of the machine hits every loop
    for repeat in range(args.repeats):
        for kind, (wait, cost, workers) in kinds.items():
            for loop in LOOPS:
                took = _loop_epoch(
                    loop,
                    accelerator,
                    CostlyItems(n, cost, wait=wait),
                    workers,
                    args,
                    folder,
                    f"{repeat}-{kind[:5]}",
                )
                best[kind, loop] = min(best[kind, loop], took)
    return [
        [
            kind,
            label,
            f"{n / best[kind, loop]:,.0f}",
            f"{best[kind, 'plain'] / best[kind, loop]:.1%}",
            f"{1000 * best['instant', loop] / args.loop_batches:.2f}",
        ]
        for kind in list(kinds)[:2]
        for loop, label in LOOPS.items()
    ]


def glue_cost(accelerator, args) -> tuple[float, float]:
    """(us per batch iterating the loader directly, through `AcceleratedLoader`): instant items,
    no workers, best of 3 in turns."""
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for wrapped in (False, True):
            loader = make_loader(
                CostlyItems(args.loop_batches * args.batch_size, 0.0),
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=0,
            )
            iterable = loader
            if wrapped:
                iterable = AcceleratedLoader(loader, accelerator=accelerator)
            start = time.perf_counter()
            for _batch in iterable:
                pass
            best[wrapped] = min(
                best[wrapped], (time.perf_counter() - start) / args.loop_batches * 1e6
            )
    return best[0], best[1]
