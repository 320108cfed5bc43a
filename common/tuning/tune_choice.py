"""How `autotune` picks among its trials, and the sentence that says why.

Use when: you have trial rows (`autotune`'s `TuneResult.trials`, or your own measures in the same
shape) and want the cheapest setting that feeds the step, or the settings `make_loader` takes.
Cost: a pass over a handful of rows.
Adapt here: `GAIN` (what counts as "helping"), `WAIT_TARGET`, `trial_cost` (which setting is
cheaper: fewer processes first).
Trade-off: "cheapest" counts processes and batches in flight, not the memory measured; a memory
budget only rules settings out.
Copy with: nothing.
"""

from __future__ import annotations

from typing import Any

GAIN = 1.05  # a setting helps when it is at least 5% faster than the best so far
WAIT_TARGET = 0.10  # with a step: the cheapest setting whose data wait is under 10%


def is_fed(row: dict[str, Any]) -> bool:
    """The loop waits under 10% of its time for data, and keeps 90% of its step's rate alone
    or more (no step: never fed)."""
    wait = row["wait_fraction"]
    if wait is None or not wait < WAIT_TARGET:
        return False
    kept = row.get("kept")
    return kept is None or kept >= 1 - WAIT_TARGET


def over_budget(row: dict[str, Any], budget: int | None) -> bool:
    """The trial's peak memory exceeds `budget` (never without one)."""
    return budget is not None and row["peak_bytes"] > budget


def trial_cost(row: dict[str, Any]) -> tuple[int, int, int]:
    """Processes first (the main process only: 0 workers, then its threads; one child: the
    isolated threads, then 1 worker), then batches in flight."""
    if row["path"] == "threads":
        return 0, 1, 0
    if row["path"] == "isolated":
        return 1, 0, 0
    return row["num_workers"], int(row["num_workers"] > 0), row["prefetch_factor"] or 0


def setting_key(row: dict[str, Any]) -> tuple[str, int, int | None]:
    """What identifies a trial's setting: its path, workers and prefetch factor."""
    return row["path"], row["num_workers"], row["prefetch_factor"]


def setting_label(row: dict[str, Any]) -> str:
    """The trial's setting in words."""
    if row["path"] == "threads":
        return "threads of this process (path='threads')"
    if row["path"] == "isolated":
        return "threads of one child process (path='isolated')"
    return f"workers={row['num_workers']} prefetch={row['prefetch_factor'] or '-'}"


def choose_trial(
    trials: list[dict[str, Any]], with_step: bool, budget: int | None
) -> dict[str, Any]:
    """The cheapest fed trial with a step; else the cheapest within `GAIN` of the fastest.
    Trials over `budget` are left out, unless all are: then the one with the lowest peak."""
    fitting = [t for t in trials if not over_budget(t, budget)]
    if not fitting:
        fitting = [min(trials, key=lambda t: t["peak_bytes"])]
    if with_step:
        fed = [t for t in fitting if is_fed(t)]
        if fed:
            return min(fed, key=trial_cost)
    fastest = max(t["samples_per_s"] for t in fitting)
    return min((t for t in fitting if t["samples_per_s"] * GAIN >= fastest), key=trial_cost)


def loader_settings(row: dict[str, Any], batch_size: int, with_path: bool) -> dict[str, Any]:
    """The `make_loader` arguments of the chosen trial (`with_path`: the dataset could take
    threads, so `make_loader`'s "auto" is told it measured workers)."""
    if row["path"] != "workers":
        return {"batch_size": batch_size, "path": row["path"]}
    settings: dict[str, Any] = {"batch_size": batch_size, "num_workers": row["num_workers"]}
    if with_path:
        settings["path"] = "workers"
    if row["num_workers"]:
        settings.update(prefetch_factor=row["prefetch_factor"], persistent_workers=True)
    return settings


def choice_reason(row: dict[str, Any], with_step: bool, budget: int | None) -> str:
    """Why `row` was chosen, in a sentence."""
    rate = f"{row['samples_per_s']:,.1f} samples/s"
    if with_step and is_fed(row):
        kept = ""
        if row.get("kept") is not None:
            kept = f", the step at {row['kept']:.0%} of its rate alone"
        why = (
            f"the cheapest setting whose data wait is under {WAIT_TARGET:.0%} "
            f"({row['wait_fraction']:.1%}{kept}), {rate}"
        )
    else:
        why = f"the cheapest setting within {GAIN - 1:.0%} of the fastest rate, {rate}"
    if budget is not None and over_budget(row, budget):
        why += (
            f"; no setting fits the memory budget of {budget / 2**20:,.0f} MiB: the lowest peak, "
            f"{row['peak_bytes'] / 2**20:,.0f} MiB"
        )
    elif budget is not None:
        why += f", within the memory budget of {budget / 2**20:,.0f} MiB"
    return f"autotune: {setting_label(row)}, {why}"
