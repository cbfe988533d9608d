"""What every launcher shares: a context manager and a lifecycle around one child process,
free ports picked again when another process takes them before the child binds them, and a
readiness probe over HTTP (plain or mutual TLS)."""

from __future__ import annotations

import functools
import re
import ssl
from collections.abc import Callable
from types import TracebackType
from typing import ClassVar, Self

import httpx

from controlplane.local.process import LauncherError, ManagedProcess, free_port
from xdsserver.identity import TlsFiles

_HTTP_TIMEOUT = 1.0
PORT_TRIES = 3
"""Starts a launcher makes when ports it picked are taken before its child binds them."""


@functools.cache
def default_verify() -> ssl.SSLContext:
    """httpx's default verification context (its CA bundle, or `SSL_CERT_FILE`), built once.

    httpx builds this for every client it makes, `httpx.get` included: loading the bundle
    takes some 50 ms of CPU, while the request to a local child takes about 1 ms. Readiness
    probes and admin polls make many such requests a second; sharing the context (OpenSSL
    contexts are safe to share between threads) keeps them cheap and verifies as before.
    """
    return httpx.create_ssl_context()


def http_get(url: str, tls: TlsFiles | None = None) -> httpx.Response | None:
    """GET with a short timeout; None when nothing answers. With `tls`, the server is checked
    against `tls.client_ca` and `tls.cert`/`tls.key` are presented as the client certificate."""
    try:
        if tls is None:
            return httpx.get(url, timeout=_HTTP_TIMEOUT, verify=default_verify())
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
