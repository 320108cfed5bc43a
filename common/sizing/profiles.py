"""Loader profiles: the production decision matrix for DataLoader settings, as data.

Use when: you want settings with reasons rather than flags copied from a forum. `make_loader`
applies a profile; `recipes doctor` prints every profile for this machine.
Cost: arithmetic over a `Resources` snapshot.
Adapt here: the numbers in `_PROFILE_TABLE` (batch size, prefetch, worker ranges).
Trade-off: profiles are starting points for a decode-bound loader; `recipes bench` measures.

| profile    | workers                    | prefetch | persistent | pin        | batch |
|------------|----------------------------|----------|------------|------------|-------|
| debug      | 0                          | -        | -          | no         | 32    |
| production | smart_num_workers          | 2        | yes        | when CUDA  | 32    |
| memory     | 2-4 (within resources)     | 1        | no         | when CUDA  | 16    |
| throughput | 8-16 (within resources)    | 1        | yes        | when CUDA  | 64    |
| text       | as production               | 2        | yes        | no         | 32    |
| auto       | production, or memory when the in-flight estimate exceeds the budget |
Copy with: common/sizing/resources.py, common/sizing/sizing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from recipes.common.sizing.resources import Resources
from recipes.common.sizing.sizing import (
    WORKER_MEMORY_BYTES,
    estimate_loader_memory,
    loader_memory_budget,
    max_workers_for_memory,
    ranks_or_env,
    resources_or_detect,
    smart_num_workers,
)

Profile = Literal["debug", "production", "memory", "throughput", "text", "auto"]
PROFILES: tuple[str, ...] = ("debug", "production", "memory", "throughput", "text", "auto")

# prefetch, persistent, batch size, pin allowed
_PROFILE_TABLE: dict[str, tuple[int, bool, int, bool]] = {
    "production": (2, True, 32, True),
    "memory": (1, False, 16, True),
    "throughput": (1, True, 64, True),
    "text": (2, True, 32, False),
}


@dataclass(frozen=True)
class LoaderRecipe:
    """The DataLoader settings a profile chose, and why.

    Attributes:
        profile: the profile that was applied (`auto` resolves to `production` or `memory`).
        settings: DataLoader keyword arguments (callables shown by name).
        reasons: a sentence per setting.
    """

    profile: str
    settings: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def memory_estimate(self, sample_bytes: int) -> int:
        """`estimate_loader_memory` for these settings and samples of `sample_bytes`."""
        s = self.settings
        return estimate_loader_memory(
            num_workers=s["num_workers"],
            batch_size=s["batch_size"],
            sample_bytes=sample_bytes,
            prefetch_factor=s.get("prefetch_factor"),
        )

    def __str__(self) -> str:
        lines = [f"profile: {self.profile}"]
        for key, value in self.settings.items():
            lines.append(f"  {key} = {value!r}  # {self.reasons.get(key, '')}")
        return "\n".join(lines)


def profile_settings(
    profile: str,
    resources: Resources | None = None,
    *,
    sample_bytes: int | None = None,
    local_world_size: int | None = None,
    cuda_available: bool | None = None,
) -> LoaderRecipe:
    """The settings of one profile on this machine.

    Args:
        profile: one of `PROFILES`.
        resources: a snapshot; `detect_resources()` when None.
        sample_bytes: bytes of one collated sample when known (bounds workers by memory and
            decides `auto`).
        local_world_size: ranks on this node; `LOCAL_WORLD_SIZE` when None.
        cuda_available: whether to pin; `torch.cuda.is_available()` when None.

    Returns:
        A `LoaderRecipe` with `num_workers`, `batch_size`, `pin_memory` and, with workers,
        `prefetch_factor` and `persistent_workers`.

    Raises:
        ValueError: for an unknown profile.
    """
    if profile not in PROFILES:
        raise ValueError(
            f"`profile` must be one of {', '.join(PROFILES)}, but is {profile!r} instead."
        )
    res = resources_or_detect(resources)
    ranks = ranks_or_env(local_world_size)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()

    if profile == "debug":
        return LoaderRecipe(
            "debug",
            {"num_workers": 0, "batch_size": 32, "pin_memory": False},
            {
                "num_workers": "0 workers: errors and breakpoints happen in the main process",
                "batch_size": "debug default",
                "pin_memory": "off: no copy thread to hide errors behind",
            },
        )
    if profile == "auto":
        return _auto(res, ranks, sample_bytes, cuda_available)
    return _workers_profile(profile, res, ranks, sample_bytes, cuda_available)


def _auto(res: Resources, ranks: int, sample_bytes: int | None, cuda: bool) -> LoaderRecipe:
    # Judge production as it would run (workers not yet lowered to fit the budget).
    production = _workers_profile("production", res, ranks, None, cuda)
    if sample_bytes is None:
        return _with_reason(production, "profile", "auto: sample size unknown, production chosen")
    estimate = production.memory_estimate(sample_bytes)
    budget = loader_memory_budget(res, local_world_size=ranks)
    if estimate <= budget:
        production = _workers_profile("production", res, ranks, sample_bytes, cuda)
        why = (
            f"auto: production's in-flight estimate {estimate / 2**20:.0f} MiB fits the budget "
            f"{budget / 2**20:.0f} MiB"
        )
        return _with_reason(production, "profile", why)
    memory = _workers_profile("memory", res, ranks, sample_bytes, cuda)
    why = (
        f"auto: production's in-flight estimate {estimate / 2**20:.0f} MiB exceeds the budget "
        f"{budget / 2**20:.0f} MiB"
    )
    return _with_reason(memory, "profile", why)


def _with_reason(recipe: LoaderRecipe, key: str, reason: str) -> LoaderRecipe:
    return LoaderRecipe(recipe.profile, dict(recipe.settings), {**recipe.reasons, key: reason})


def _workers_profile(
    profile: str, res: Resources, ranks: int, sample_bytes: int | None, cuda: bool
) -> LoaderRecipe:
    prefetch, persistent, batch_size, pin_allowed = _PROFILE_TABLE[profile]
    workers, why = _profile_workers(profile, res, ranks)
    if sample_bytes is not None and workers > 0:
        fit = max_workers_for_memory(
            loader_memory_budget(res, local_world_size=ranks),
            batch_size=batch_size,
            sample_bytes=sample_bytes,
            prefetch_factor=prefetch,
        )
        if fit < workers:
            workers = max(1, fit)
            why += f"; lowered to {workers} so in-flight batches fit half the memory"
    settings: dict[str, Any] = {"num_workers": workers, "batch_size": batch_size}
    reasons = {"num_workers": why, "batch_size": f"{profile} default"}
    if workers > 0:
        settings["prefetch_factor"] = prefetch
        settings["persistent_workers"] = persistent
        reasons["prefetch_factor"] = "1 batch queued per worker: the least memory in flight"
        if prefetch == 2:
            reasons["prefetch_factor"] = "2 batches queued per worker hide decode-time jitter"
        reasons["persistent_workers"] = "workers exit each epoch and release their memory"
        if persistent:
            reasons["persistent_workers"] = (
                "keep workers between epochs: no respawn stall, no re-import"
            )
    settings["pin_memory"] = pin_allowed and cuda
    reasons["pin_memory"] = _pin_reason(pin_allowed, cuda)
    return LoaderRecipe(profile, settings, reasons)


def _pin_reason(pin_allowed: bool, cuda: bool) -> str:
    if not pin_allowed:
        return "off for text: small int batches copy fast, pinning costs more than it saves"
    if cuda:
        return "on: CUDA is available"
    return "off: no CUDA device"


def _profile_workers(profile: str, res: Resources, ranks: int) -> tuple[int, str]:
    smart = smart_num_workers(res, local_world_size=ranks)
    cpus = res.cpus // ranks
    if profile in ("production", "text"):
        return smart, f"smart_num_workers: {res.cpus} effective CPUs, {ranks} rank(s) on this node"
    # Never more workers than spare CPUs (one is the main process) or 2 GiB memory shares.
    ceiling = max(1, min(cpus - 1, res.memory_available // ranks // WORKER_MEMORY_BYTES))
    if profile == "memory":
        workers = min(max(smart, 2), 4, ceiling)
        return workers, f"2-4 workers within resources ({cpus} CPUs for this rank)"
    workers = min(max(smart, 8), 16, ceiling)
    return workers, f"8-16 workers within resources ({cpus} CPUs for this rank)"
