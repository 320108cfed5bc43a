"""`TrainSetup`: what each `recipes.bench.<domain>` hands `recipes bench train`'s runner.

It lives apart from the runner (`recipes.bench.harness.train`), which loads the domain modules by
name: they import it from here, not the runner back.

Use when: writing a domain's `train_setup(args, device)` for `recipes bench train`.
Cost: none; a dataclass.
Adapt here: add a field when a domain has more to report; the runner prints `notes` as text.
Trade-off: loaders are plain `(name, loader, to_device)` rows, not a class per loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainSetup:
    """What a domain hands the runner.

    `loaders` are `(name, DataLoader, to_device)` rows: `to_device(batch)` returns what
    `step` takes, on the device, and `count` counts samples in that. `resident` is one such
    batch, for the model alone.
    """

    unit: str
    step: Callable[[Any], None]
    count: Callable[[Any], int]
    resident: Any
    loaders: list[tuple[str, Any, Callable[[Any], Any]]]
    model: str
    notes: list[str] = field(default_factory=list)
