"""Simulated nodes on one machine: one `torchrun --nnodes N --node-rank K` launch per node on
127.0.0.1, each in its own working directory with its own `TMPDIR`.

Use when: a test or `recipes bench nodes` runs a job on several nodes without a shared disk: a
relative cache folder then lives on "its own disk", and nothing is shared between the nodes but
what the job is given (read-only data, an S3 bucket in moto, a checkpoint folder).
Cost: a torchrun launch per node (its ranks import torch: seconds each on 2 cores).
Adapt here: nothing; `start_nodes` takes the script and its arguments.
Trade-off: the nodes share this machine's cores and memory, so times are not a cluster's; what
is counted (decodes, downloads, samples) is.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """One node's launch: its folder, its torchrun process, and what it printed."""

    folder: Path
    process: subprocess.Popen
    stdout: str = ""
    stderr: str = ""

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


def start_nodes(
    folders: list[Path],
    script: Path,
    *args: str,
    per_node: int = 2,
    env: dict | None = None,
    port: int | None = None,
) -> list[Node]:
    """Starts one torchrun launch per folder (node K in folders[K]), `per_node` ranks each."""
    port = port or free_port()
    nodes = []
    for k, folder in enumerate(folders):
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        node_env = {
            **os.environ,
            **(env or {}),
            "TMPDIR": str(folder / "tmp"),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(folders)}",
            f"--node-rank={k}",
            f"--nproc-per-node={per_node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=0",
            str(script),
            *args,
        ]
        # noqa: SIM115
        out = open(folder / "stdout.log", "w")
        err = open(folder / "stderr.log", "w")
        nodes.append(
            Node(
                folder,
                subprocess.Popen(
                    command,
                    cwd=folder,
                    env=node_env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                ),
            )
        )
    return nodes


def wait_nodes(nodes: list[Node], timeout: float) -> list[Node]:
    """Waits for every node's launch to end (killing all of them after `timeout` s)."""
    deadline = time.monotonic() + timeout
    try:
        for node in nodes:
            node.process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException as stop:  # a timeout, or the caller interrupted (a test's time limit)
        for node in nodes:
            kill_node(node)
        if not isinstance(stop, subprocess.TimeoutExpired):
            raise

    for node in nodes:
        node.process.wait()
        node.stdout = (node.folder / "stdout.log").read_text()
        node.stderr = (node.folder / "stderr.log").read_text()
    return nodes


def kill_node(node: Node) -> None:
    """SIGKILLs a node's launch and every process under it (a lost node). torchrun starts each
    rank in a session of its own, so the launch's process group does not reach them: the tree
    is walked through /proc."""
    for pid in [*_descendants(node.process.pid), node.process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_nodes(
    folders: list[Path],
    script: Path,
    *args: str,
    per_node: int = 2,
    timeout: float = 240,
    env: dict | None = None,
) -> list[Node]:
    return wait_nodes(start_nodes(folders, script, *args, per_node=per_node, env=env), timeout)


def report(nodes: list[Node]) -> str:
    return "\n".join(
        f"--- node {k} (rc {n.returncode})\n{n.stdout[-2000:]}\n{n.stderr[-4000:]}"
        for k, n in enumerate(nodes)
    )
