"""Several ASGI apps in one process, each on its own port: how `python -m replicasim` serves
its replicas (and the tests' gated backend its own).

The parent learns the ports from one JSON line on stdout (`ServerGroup.announce`); the
launcher's side of that line is `controlplane.asgi.read_announcement`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import Iterator, Sequence

import uvicorn
from starlette.types import ASGIApp


class UvicornServer(uvicorn.Server):
    """uvicorn without its signal handlers: the group owns SIGINT/SIGTERM and stops every
    server (uvicorn would otherwise install its own handlers and re-raise the signal after it
    stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ServerGroup:
    """Several ASGI apps in one process, each on its own socket: they start together, say
    when all of them listen, and stop together on SIGTERM/SIGINT (simulated model replicas:
    one process, many ports)."""

    def __init__(
        self,
        apps: Sequence[ASGIApp],
        host: str,
        ports: Sequence[int] | None = None,
        *,
        graceful_shutdown: int = 2,
    ) -> None:
        """Bind every socket now (port 0 picks a free one); nothing is served until `start`.
        `graceful_shutdown` is the seconds in-flight requests get once asked to stop."""
        self.sockets = [_bind(host, port) for port in (ports or [0] * len(apps))]
        self.servers = [
            UvicornServer(
                uvicorn.Config(
                    app,
                    lifespan="off",
                    access_log=False,
                    log_level="warning",
                    timeout_graceful_shutdown=graceful_shutdown,
                )
            )
            for app in apps
        ]
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def ports(self) -> list[int]:
        """The port of each app, in order."""
        return [sock.getsockname()[1] for sock in self.sockets]

    def request_exit(self) -> None:
        """Ask every server to stop (in-flight requests get the graceful-shutdown time)."""
        for server in self.servers:
            server.should_exit = True

    async def start(self) -> bool:
        """Serve every app and wait until all listen. False if one failed first; the others
        are then told to stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_exit)
        self.tasks = [
            asyncio.create_task(server.serve(sockets=[sock]))
            for server, sock in zip(self.servers, self.sockets, strict=True)
        ]
        while not all(server.started for server in self.servers):
            if any(task.done() for task in self.tasks):
                self.request_exit()
                return False
            await asyncio.sleep(0.01)
        return True

    def announce(self, ids: Sequence[str]) -> None:
        """Tell the parent process where each app listens: one JSON line on stdout,
        ``{"replicas": [{"id": ..., "port": ...}, ...]}``, read back by `read_announcement`."""
        replicas = [{"id": id_, "port": port} for id_, port in zip(ids, self.ports, strict=True)]
        print(json.dumps({"replicas": replicas}), flush=True)

    async def wait(self) -> None:
        """Until every server has stopped."""
        await asyncio.gather(*self.tasks)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
