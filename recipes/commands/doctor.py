"""`recipes doctor`: this machine's data-loading report, with warnings that say the fix."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
from importlib import metadata
from typing import Any

import torch

from recipes.common.loading.worker_rules import LOW_NOFILE
from recipes.common.sizing.profiles import PROFILES, profile_settings
from recipes.common.sizing.resources import GiB, Resources, detect_resources
from recipes.common.sizing.sizing import (
    estimate_loader_memory,
    loader_memory_budget,
    local_world_size_from_env,
)

# One ImageNet sample as a float32 [3, 224, 224] tensor: the reference for memory estimates.
REFERENCE_SAMPLE_BYTES = 3 * 224 * 224 * 4
MANY_WORKERS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--sample-bytes",
        type=_positive_int,
        default=REFERENCE_SAMPLE_BYTES,
        help="bytes of one collated sample for memory estimates (default: float32 3x224x224)",
    )
    parser.add_argument(
        "--workers", type=_non_negative_int, default=None, help="check a planned num_workers"
    )
    parser.add_argument("--cgroup-root", default="/sys/fs/cgroup", help=argparse.SUPPRESS)
    parser.add_argument("--shm-path", default="/dev/shm", help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    resources = detect_resources(cgroup_root=args.cgroup_root, shm_path=args.shm_path)
    report = build_report(resources, sample_bytes=args.sample_bytes, planned_workers=args.workers)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def build_report(
    resources: Resources,
    *,
    sample_bytes: int = REFERENCE_SAMPLE_BYTES,
    planned_workers: int | None = None,
    local_world_size: int | None = None,
    cuda_available: bool | None = None,
) -> dict[str, Any]:
    """The doctor report as a JSON-able dict."""
    ranks = local_world_size
    if ranks is None:
        ranks = local_world_size_from_env()
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    visible_gpus = 0
    if cuda_available:
        visible_gpus = resources.gpus
    profiles = {}
    for name in PROFILES:
        recipe = profile_settings(
            name, resources, local_world_size=ranks, cuda_available=cuda_available
        )
        profiles[name] = {
            "settings": recipe.settings,
            "reasons": recipe.reasons,
            "memory_estimate_bytes": recipe.memory_estimate(sample_bytes),
        }
    report = {
        "cpus": {
            "logical": resources.cpus_logical,
            "affinity": resources.cpus_affinity,
            "cgroup_quota": resources.cpu_quota,
            "effective": resources.cpus,
        },
        "memory": {
            "total_bytes": resources.memory_total,
            "cgroup_limit_bytes": resources.memory_limit,
            "cgroup_usage_bytes": resources.memory_usage,
            "effective_available_bytes": resources.memory_available,
            "loader_budget_bytes": loader_memory_budget(resources, local_world_size=ranks),
        },
        "shm": {"bytes": resources.shm_bytes, "free_bytes": resources.shm_free},
        "nofile_limit": resources.nofile_limit,
        "gpus": {
            "count": resources.gpus,
            "names": _gpu_names(visible_gpus),
        },
        "local_world_size": ranks,
        "versions": _versions(),
        "multiprocessing": {
            "start_method": multiprocessing.get_context().get_start_method(),
            "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
        },
        "sample_bytes": sample_bytes,
        "profiles": profiles,
    }
    report["warnings"] = _warnings(report, resources, planned_workers)
    return report


def _warnings(report: dict, res: Resources, planned: int | None) -> list[dict[str, str]]:
    out = []
    production_workers = report["profiles"]["production"]["settings"]["num_workers"]
    workers = planned
    if workers is None:
        workers = production_workers
    if workers > 0 and res.shm_bytes < GiB:
        out.append(
            {
                "problem": (
                    f"/dev/shm is {res.shm_bytes / 2**20:.0f} MiB and workers send every batch "
                    "through it; it fills and workers die with 'Bus error' (Docker's default is "
                    "64 MB)"
                ),
                "fix": "run the container with --shm-size=8g or --ipc=host",
            }
        )
    budget = report["memory"]["loader_budget_bytes"]
    for name, profile in report["profiles"].items():
        if profile["memory_estimate_bytes"] > budget:
            out.append(
                {
                    "problem": (
                        f"profile {name}: batches in flight need about "
                        f"{profile['memory_estimate_bytes'] / 2**20:,.0f} MiB, over the loader "
                        f"budget of {budget / 2**20:,.0f} MiB (half of the effective available "
                        "memory)"
                    ),
                    "fix": "use profile='memory' or a smaller batch_size / prefetch_factor",
                }
            )
    if planned is not None:
        s = report["profiles"]["production"]["settings"]
        estimate = estimate_loader_memory(
            num_workers=planned,
            batch_size=s["batch_size"],
            sample_bytes=report["sample_bytes"],
            prefetch_factor=2,
        )
        if estimate > budget:
            out.append(
                {
                    "problem": (
                        f"{planned} workers hold about {estimate / 2**20:,.0f} MiB of batches in "
                        f"flight, over the loader budget of {budget / 2**20:,.0f} MiB"
                    ),
                    "fix": (
                        f"use at most {report['profiles']['memory']['settings']['num_workers']} "
                        "workers or prefetch_factor=1"
                    ),
                }
            )
    if res.nofile_limit < LOW_NOFILE:
        out.append(
            {
                "problem": (
                    f"ulimit -n is {res.nofile_limit}; shared tensors each hold a file descriptor "
                    "('received 0 items of ancdata', 'Too many open files')"
                ),
                "fix": (
                    "ulimit -n 65536 (make_loader switches to the file_system sharing strategy "
                    "meanwhile)"
                ),
            }
        )
    if workers > MANY_WORKERS:
        out.append(
            {
                "problem": (
                    f"{workers} workers: past {MANY_WORKERS} returns vanish while memory and "
                    "start-up time grow"
                ),
                "fix": (
                    f"use at most {MANY_WORKERS} workers per rank, or cache decoded data (recipes "
                    "cache)"
                ),
            }
        )
    return out


def _gpu_names(count: int) -> list[str]:
    if count == 0:
        return []

    return [torch.cuda.get_device_name(i) for i in range(count)]


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist, key in (
        ("loader-recipes", "recipes"),
        ("torch", "torch"),
        ("torchvision", "torchvision"),
        ("torchaudio", "torchaudio"),
        ("opencv-python-headless", "opencv"),
        ("numpy", "numpy"),
    ):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def format_report(report: dict) -> str:
    """The report as text for a terminal."""
    mib = 2**20
    cpus = report["cpus"]
    mem = report["memory"]
    shm = report["shm"]

    def size(value):
        if value is None:
            return "none"
        return f"{value / mib:,.0f} MiB"

    quota = "none"
    if cpus["cgroup_quota"] is not None:
        quota = f"{cpus['cgroup_quota']:g}"
    lines = [
        "recipes doctor: data-loading report",
        f"  CPUs        logical {cpus['logical']}, affinity {cpus['affinity']}, cgroup quota "
        f"{quota} -> effective {cpus['effective']}",
        f"  memory      total {size(mem['total_bytes'])}, cgroup limit "
        f"{size(mem['cgroup_limit_bytes'])}, cgroup usage {size(mem['cgroup_usage_bytes'])} -> "
        f"effective available {size(mem['effective_available_bytes'])}",
        f"  /dev/shm    {size(shm['bytes'])} ({size(shm['free_bytes'])} free)",
        f"  ulimit -n   {report['nofile_limit']}",
        f"  GPUs        {report['gpus']['count']} {', '.join(report['gpus']['names'])}".rstrip(),
        f"  ranks here  {report['local_world_size']} (LOCAL_WORLD_SIZE)",
        "  versions    " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        f"  processes   start method {report['multiprocessing']['start_method']}, "
        f"sharing strategy {report['multiprocessing']['sharing_strategy']}",
        "",
        f"Recommended DataLoader settings (memory estimates for {report['sample_bytes']:,}-byte "
        "samples):",
    ]
    for name, profile in report["profiles"].items():
        settings = ", ".join(f"{k}={v}" for k, v in profile["settings"].items())
        lines.append(
            f"  {name:<11} {settings}  (~{profile['memory_estimate_bytes'] / mib:,.0f} MiB in "
            "flight)"
        )
    lines.append("")
    if report["warnings"]:
        lines.append("Warnings:")
        for w in report["warnings"]:
            lines.append(f"  ! {w['problem']}\n    fix: {w['fix']}")
    else:
        lines.append("No warnings.")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, but is {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, but is {value}")
    return value
