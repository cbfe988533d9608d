"""Finding the processes a test started, however deep, telling when they are gone, and
freezing one (an etcd that stops answering)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from controlplane.local import EmbeddedEtcd


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of the running processes whose environment has `name`=`value`.

    Children inherit their parent's environment even when they start their own session, so a
    marker set on a command finds everything it started, however deep.
    """
    marker = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in environ.split(b"\0") and not process_gone(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_until_stopped(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP lands when each thread next leaves the kernel: a request in flight can still
    be answered after kill() returns. Wait until every thread shows the stopped state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                # The state follows the parenthesised command name, which may hold spaces.
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"etcd (pid {pid}) did not stop within {timeout} s")


@contextlib.contextmanager
def frozen(server: EmbeddedEtcd) -> Iterator[None]:
    """etcd stops answering but keeps its connections: requests are sent, never confirmed."""
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
