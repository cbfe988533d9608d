"""Running ASGI apps (the REST API, simulated replicas) inside a process that owns its signals."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn


class UvicornServer(uvicorn.Server):
    """uvicorn without its signal handlers, for servers that run inside a process that owns
    SIGINT/SIGTERM and shuts every part down in order (uvicorn would otherwise install its own
    handlers and re-raise the signal after it stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
