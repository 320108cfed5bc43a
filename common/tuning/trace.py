"""`profile_trace`: a Chrome trace of a few steps, with every data fetch marked.

Use when: `LoaderMonitor` says the loop waits for data and you want to see where: open the
file in `chrome://tracing` or https://ui.perfetto.dev. Each `next(loader)` is a `data_fetch`
span, each step a `train_step` span; with CUDA the kernels appear on their streams below.
Cost: torch.profiler's overhead (tens of microseconds per op) for `steps` batches only.
Adapt here: `activities`, or pass `step=` to see the step beside the fetches.
Trade-off: a handful of steps, not an epoch; the profiler itself slows what it records a little.
Copy with: nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def profile_trace(
    loader,
    path: str | os.PathLike,
    *,
    steps: int = 20,
    step: Callable[[object], object] | None = None,
) -> Path:
    """Profiles `steps` batches of `loader` (and `step(batch)` on each) into a Chrome trace.

    Args:
        loader: a DataLoader or any iterable of batches.
        path: the `.json` trace to write (folders are created).
        steps: batches to record.
        step: called on each batch inside a `train_step` span (your forward/backward).

    Returns:
        The trace's path.

    Raises:
        ValueError: `steps` is not positive.

    Example:
        >>> profile_trace(loader, "trace.json", steps=30, step=train_step)
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if steps <= 0:
        raise ValueError(f"`steps` must be positive, but is {steps!r} instead.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    iterator = iter(loader)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("data_fetch"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
            if step is not None:
                with record_function("train_step"):
                    step(batch)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path
