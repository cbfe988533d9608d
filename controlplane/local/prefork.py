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
import sys
import time
import traceback
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
    """In the grandchild: wait to be adopted, take the request's files, run its module, exit."""
    os.setsid()
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
    """Fork twice; the middle process exits, so the grandchild goes to the requester."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            child = os.fork()
            if child == 0:
                os.close(write)
                try:
                    _run_child(request, requester, prctl)
                finally:
                    os._exit(70)
            os.write(write, str(child).encode())
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


if __name__ == "__main__":
    serve(sys.argv[1:])
