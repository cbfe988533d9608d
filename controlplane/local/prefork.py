"""Start kvpilot's Python commands by forking a process that has imported them already.

`python -m commands.cli serve` spends about 1.5 s of CPU importing FastAPI, gRPC, pydantic and
kvpilot's packages before it does anything, and the end-to-end tests start over a hundred of
them on a 2-core machine. A prefork server (`python -m controlplane.local.prefork MODULE...`)
imports the given modules once, then forks a child for each start it is asked for; the child
takes the requested log files, working directory, environment and arguments and runs the
module as `python -m` would. It is for the local stack only (`ManagedProcess` uses it once
`enable_prefork` is called; the tests do), never for production.

The child must be the requester's own child, so that `ManagedProcess` can wait for it, read
its exit status and signal its process group as it does for any `Popen`: the requester makes
itself a child subreaper (`PR_SET_CHILD_SUBREAPER`), the server forks twice, and the middle
process exits at once, so the kernel hands the grandchild to the requester. The grandchild
asks for SIGKILL when the requester dies, as `Popen` children do; the server exits when its
request pipe closes. A side effect of the subreaper: a descendant orphaned under the requester
(a killed server's own child) is reparented to it and stays a zombie until the requester
exits.

Forking is safe here because the server runs one thread and has only imported modules (no
event loop, no gRPC channel, no open connection). The environment variables that Python reads
at start (`PYTHON*`) and the working directory (`sys.path[0]` under `-m`) are the server's, so
a start that asks for other values is not sent here.

Both sides live here: `serve` is the server; `PreforkClient` (which starts it and asks it
for children) and `Adopted` (a child's handle) are the requester's, used by `ManagedProcess`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
ADOPTION_TIMEOUT = 5.0
"""Seconds a child waits to be handed to the requester before it gives up."""


def _prctl() -> Any:
    return ctypes.CDLL(None, use_errno=True).prctl


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(_prctl()(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))


def _exit_code(code: object) -> int:
    """`sys.exit(code)`'s status, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(request: dict[str, Any], requester: int, prctl: Any) -> None:
    """In the grandchild (in a session of its own already, ``_fork``): wait to be adopted,
    take the request's files, run its module, exit."""
    deadline = time.monotonic() + ADOPTION_TIMEOUT
    while os.getppid() != requester:
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.0005)
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != requester:  # it died between the two checks
        os._exit(70)
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    out = log
    if request.get("stdout"):
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(log, 2)
    for fd in _open_fds():
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [request["module"], *request["args"]]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def _fork(request: dict[str, Any], requester: int, prctl: Any) -> int:
    """Fork twice; the middle process exits, so the grandchild goes to the requester. The
    grandchild tells its pid once it leads a session of its own (the pipe's last writer)."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            if os.fork() == 0:
                try:
                    # Its own session before its pid is told: a requester that signals the
                    # group at once finds it.
                    os.setsid()
                    os.write(write, str(os.getpid()).encode())
                    os.close(write)
                    _run_child(request, requester, prctl)
                finally:
                    os._exit(70)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(middle, 0)
    if not answer:
        raise OSError("the prefork server could not fork")
    return int(answer)


def serve(modules: list[str]) -> None:
    """Import `modules`, then answer one start per line of standard input until it closes."""
    for module in modules:
        importlib.import_module(module)
    prctl = _prctl()
    requester = os.getppid()
    requests = os.fdopen(0, "rb", buffering=0)
    pending = b""
    while True:
        chunk = requests.read(65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                answer: dict[str, Any] = {"pid": _fork(json.loads(line), requester, prctl)}
            except Exception as exc:  # the requester falls back and says why
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(1, json.dumps(answer).encode() + b"\n")


# --------------------------------------------------------------------------- the requester's side


class PreforkError(RuntimeError):
    """The prefork server could not start a child (the requester then uses `Popen`)."""


class Adopted:
    """A child the prefork server forked and the kernel handed to this process (a subreaper):
    what `ManagedProcess` uses of a `Popen`, over `waitpid`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0  # reaped elsewhere: Popen says 0 then too
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        return code


def _python_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables Python reads when it starts: a forked child keeps the server's."""
    return {key: value for key, value in env.items() if key.startswith("PYTHON")}


class PreforkClient:
    """The requester's side of `controlplane.local.prefork`: one server, started at the first
    start it can take, asked over a pipe (one start at a time)."""

    def __init__(self, modules: Sequence[str], cwd: Path) -> None:
        self.modules = list(modules)
        self.cwd = cwd
        """Where the server runs, and the only working directory its children can have (it is
        `sys.path[0]` under `-m`)."""
        self.python_env = _python_env(os.environ)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def module_for(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None) -> str:
        """The module of a `python -m MODULE ...` start this server can fork, else ''."""
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            return ""
        module = argv[2]
        preloaded = any(m == module or m.startswith(module + ".") for m in self.modules)
        same_place = Path(cwd or os.getcwd()).resolve() == self.cwd
        if preloaded and same_place and _python_env(env) == self.python_env:
            return module
        return ""

    def spawn(self, request: dict[str, object]) -> int:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # Python's own variables as `module_for` compared them, whatever came since.
                env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "controlplane.local.prefork", *self.modules],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    cwd=self.cwd,
                    env=env | self.python_env,
                    close_fds=True,
                )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except OSError as exc:
                raise PreforkError(f"the prefork server is gone: {exc}") from exc
        if not line:
            raise PreforkError("the prefork server exited")
        answer = json.loads(line)
        if "error" in answer:
            raise PreforkError(f"the prefork server could not start it: {answer['error']}")
        return int(answer["pid"])

    def close(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)


if __name__ == "__main__":
    serve(sys.argv[1:])
