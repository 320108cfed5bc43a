"""Python processes for tests, forked from one fresh interpreter that has already imported the
expensive libraries. A test that needs another process (two downloaders racing, a parent to
SIGKILL, a state loaded elsewhere) gets one in milliseconds instead of paying `import torch`
(3.5 s on 2 cores) again. The zygote is a separate, fresh interpreter, never a fork of the
test session: a child shares nothing with the test's heap, threads or servers.

A child runs `code` as `python -c code *argv` would (`__name__ == "__main__"`, `sys.argv`,
the test's environment and working directory at the call), with its stdout and stderr in
files, its exit status from `SystemExit` (a message printed) or 1 on an uncaught exception
(the traceback on its stderr), after its non-daemon threads and atexit handlers. What is not
the same as a new interpreter: the preloaded modules are already imported, so environment
variables read at import (`OMP_NUM_THREADS` for torch's thread pool) keep the zygote's values;
stdin is closed; Ctrl-C exits 1, not -2; interpreter finalisation (module teardown, the
"leaked semaphore" check) does not run. Tests of those keep `subprocess`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = r"""
import atexit, importlib, json, os, sys, threading, time, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "exit":
        break
    if request["op"] == "run":
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                sys.stdin.close()
                for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                if request["cwd"]:
                    os.chdir(request["cwd"])
                sys.path.insert(0, request["cwd"] or "")
                sys.argv = ["-c", *request["argv"]]
                os.environ.clear()
                os.environ.update(request["env"])
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                if isinstance(stop.code, int):
                    status = stop.code
                elif stop.code is None:
                    status = 0
                else:
                    status = 1
                if stop.code is not None and not isinstance(stop.code, int):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                status = 1
            try:
                threading._shutdown()  # non-daemon threads finish, as at interpreter exit
                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        print(json.dumps({"pid": pid}), flush=True)
    else:  # wait: the exit status, or None after `timeout` seconds
        deadline = time.monotonic() + request["timeout"]
        while True:
            done, status = os.waitpid(request["pid"], os.WNOHANG)
            if done or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        code = os.waitstatus_to_exitcode(status) if done else None
        print(json.dumps({"status": code}), flush=True)
"""


class Zygote:
    """A server process that imported `preload` and forks a child per `python()` call."""

    def __init__(self, preload: list[str]):
        self._folder = tempfile.mkdtemp(prefix="zygote-")
        self._server = subprocess.Popen(
            [sys.executable, "-c", SERVER, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._count = 0

    def _ask(self, request: dict) -> dict:
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        answer = self._server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the zygote ended (exit status {self._server.wait()})")
        return json.loads(answer)

    def python(self, code: str, *argv, cwd=None, env: dict | None = None) -> Child:
        """`subprocess.Popen([python, "-c", code, *argv])`, forked from the zygote."""
        self._count += 1
        out = Path(self._folder) / f"{self._count}.out"
        err = Path(self._folder) / f"{self._count}.err"
        environment = {
            **os.environ,
            **(env or {}),
        }  # the test's environment now (monkeypatch.setenv included)
        pid = self._ask(
            {
                "op": "run",
                "code": code,
                "argv": [str(a) for a in argv],
                "env": environment,
                "cwd": str(cwd if cwd is not None else os.getcwd()),
                "stdout": str(out),
                "stderr": str(err),
            }
        )["pid"]
        return Child(self, pid, out, err)

    def close(self) -> None:
        """Asked, not by end of input: a process forked from the test session (a loader's
        persistent worker not yet collected) holds a copy of the pipe's write end, so the
        zygote may never read an end of input."""
        try:
            self._server.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self._server.stdin.close()
        except OSError:  # it ended already; wait() reports how
            pass
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
            raise


class Child:
    """The `Popen` subset tests use: pid, poll, wait, communicate, kill, returncode."""

    def __init__(self, zygote: Zygote, pid: int, out: Path, err: Path):
        self._zygote, self.pid, self._out, self._err = zygote, pid, out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote._ask({"op": "wait", "pid": self.pid, "timeout": 0})[
                "status"
            ]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            step = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            self.returncode = self._zygote._ask({"op": "wait", "pid": self.pid, "timeout": step})[
                "status"
            ]
            if self.returncode is None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout, self.stderr

    @property
    def stdout(self) -> str:
        return self._out.read_text() if self._out.exists() else ""

    @property
    def stderr(self) -> str:
        return self._err.read_text() if self._err.exists() else ""

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
