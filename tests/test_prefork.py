"""Starts forked from a process that imported kvpilot once (`controlplane.local.prefork`):
each child is this process's own, with its arguments, environment, log and exit status, and
it never outlives its parent. The suite's conftest enables the prefork server; these tests
run in every worker that has it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness.processes import process_gone
from harness.wait import wait_until

from controlplane.local import ManagedProcess, free_port, repo_root
from controlplane.local.process import enable_prefork


def forked_by_the_server(pid: int) -> bool:
    """A preforked child keeps the server's command line (it never execs)."""
    return b"controlplane.local.prefork" in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.fixture(autouse=True)
def prefork_enabled() -> None:
    """The conftest enabled it for every worker (a second call changes nothing): these tests
    fail rather than pass on `Popen` if it could not be."""
    assert enable_prefork(["commands.cli"])


def test_a_forked_child_runs_its_module_with_its_arguments_environment_and_log(
    tmp_path: Path,
) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    child = ManagedProcess(
        [sys.executable, "-m", "commands.cli", "get", "pools"],
        tmp_path / "cli.log",
        env={**os.environ, "KVPILOT_SERVER": unreachable},
        cwd=repo_root(),
    )
    child.spawn()
    assert child.pid is not None
    assert forked_by_the_server(child.pid)
    assert os.getsid(child.pid) == child.pid  # its own session, as Popen's children have
    wait_until(lambda: child.returncode is not None, 30, message="the CLI to exit")
    assert child.returncode == 1
    assert f"cannot reach kvpilot at {unreachable}" in child.output()


def test_an_exit_status_and_a_signal_reach_the_parent_as_popen_reports_them(
    tmp_path: Path,
) -> None:
    usage = ManagedProcess(
        [sys.executable, "-m", "commands.cli", "no-such-command"], tmp_path / "usage.log"
    )
    usage.spawn()
    wait_until(lambda: usage.returncode is not None, 30, message="argparse to refuse")
    assert usage.returncode == 2
    assert "invalid choice: 'no-such-command'" in usage.output()

    # `kvpilot serve` on its own embedded etcd, stopped with SIGKILL: -9, as Popen says.
    serve = ManagedProcess(
        [
            sys.executable,
            "-m",
            "commands.cli",
            "serve",
            "--state-dir",
            str(tmp_path / "state"),
            "--xds-address",
            f"127.0.0.1:{free_port()}",
            "--api-address",
            f"127.0.0.1:{free_port()}",
            "--xds-insecure-plaintext",
            "--insecure-no-auth",
        ],
        tmp_path / "serve.log",
    )
    serve.spawn()
    assert serve.pid is not None and forked_by_the_server(serve.pid)
    wait_until(lambda: "listening" in serve.output(), 30, message="serve to listen")
    serve.kill()
    assert serve.returncode == -signal.SIGKILL
    wait_until(lambda: process_gone(serve.pid or 0), 10, message="serve gone")


def test_a_module_the_server_did_not_import_starts_with_popen(tmp_path: Path) -> None:
    child = ManagedProcess(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
        tmp_path / "http.log",
        cwd=tmp_path,
    )
    child.spawn()
    try:
        pid = child.pid
        assert pid is not None
        wait_until(
            lambda: b"http.server" in Path(f"/proc/{pid}/cmdline").read_bytes(),
            30,
            message="the child to exec Python with its own module",
        )
        assert not forked_by_the_server(pid)
    finally:
        child.stop()
    assert child.returncode is not None


PARENT_SCRIPT = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from controlplane.local import ManagedProcess
from controlplane.local.process import enable_prefork
assert enable_prefork(["commands.cli"])
child = ManagedProcess(
    [sys.executable, "-m", "commands.cli", "serve", "--state-dir", {state!r},
     "--xds-address", "127.0.0.1:0", "--api-address", "127.0.0.1:{port}",
     "--xds-insecure-plaintext", "--insecure-no-auth"],
    Path({log!r}),
)
child.spawn()
print(child.pid, flush=True)
os._exit(1)  # no atexit, no cleanup: as if the parent were killed
"""


def test_a_forked_child_dies_with_a_parent_that_exits_without_cleanup(tmp_path: Path) -> None:
    script = PARENT_SCRIPT.format(
        root=str(repo_root()),
        state=str(tmp_path / "state"),
        port=free_port(),
        log=str(tmp_path / "serve.log"),
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=repo_root()
    )
    assert result.returncode == 1, result.stderr
    pid = int(result.stdout.strip())
    wait_until(lambda: process_gone(pid), 10, message=f"serve pid {pid} outlived its parent")
