"""Running ASGI apps inside a process that owns its signals (the REST API in `kvpilot serve`),
and reading where a child process of simulated replicas listens."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import uvicorn


class UvicornServer(uvicorn.Server):
    """uvicorn without its signal handlers, for servers that run inside a process that owns
    SIGINT/SIGTERM and shuts every part down in order (uvicorn would otherwise install its own
    handlers and re-raise the signal after it stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def read_announcement(stdout_path: Path) -> dict[str, int] | None:
    """Replica id -> port from a child's announcement line (``{"replicas": [{"id": ...,
    "port": ...}, ...]}``, written by `replicasim.group.ServerGroup.announce` and the tests'
    gated backend); None until it is written in full."""
    try:
        text = stdout_path.read_text()
    except OSError:
        return None
    if not text.endswith("\n"):
        return None
    replicas = json.loads(text.splitlines()[0])["replicas"]
    return {replica["id"]: int(replica["port"]) for replica in replicas}
