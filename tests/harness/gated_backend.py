"""Model replicas that hold requests until the test opens a gate, for end-to-end routing tests.

`replicasim` answers at once (or after simulated GPU time), so a test cannot know that a set
of requests is in flight at the same moment. Bounded load is about exactly that: where Envoy
puts a request depends on how many requests each host holds right now. These replicas count
requests in flight and keep them until `POST /admin/gate {"open": true}`, so a test can send
40 requests, wait until all 40 are held, read where they landed and then let them finish, with
no timing involved. Streams send their first chunks at once and the rest after the gate opens,
which shows whether Envoy passes chunks through as they come or buffers the response.

Each replica says who it is (`x-backend-id` header, `backend` field). It serves:

- `POST /v1/chat/completions`: JSON, or SSE chunks ending in `data: [DONE]` with `"stream": true`;
- `GET /health`: 200;
- `GET /admin/state`: `{"id", "in_flight", "served"}`;
- `POST /admin/gate {"open": bool}`: a closed gate holds requests (streams after
  `STREAM_CHUNKS_BEFORE_GATE` chunks); opening it releases them. The gate starts open.

Run it from tests/:  python -m harness.gated_backend --replicas 3 --id-prefix g
It prints `{"replicas": [{"id": "g-0", "port": 12345}, ...]}` once every replica listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from controlplane.asgi import read_announcement
from controlplane.local import ManagedProcess
from harness.wait import wait_until
from replicasim.group import ServerGroup

STREAM_CHUNKS = 6
"""Content chunks of a streamed answer, before `data: [DONE]`."""
STREAM_CHUNKS_BEFORE_GATE = 2
"""Chunks a stream sends before it waits for the gate."""
HOLD_LIMIT = 600.0
"""Seconds a request waits for the gate at most, so a forgotten gate never hangs a manual run
(the test fixtures stop the replicas anyway). Longer than a test may hold requests on a loaded
machine: 40 requests placed one by one have taken over two minutes."""


def stream_piece(index: int) -> str:
    """The content of streamed chunk `index`: a test can rebuild the whole answer."""
    return f"piece-{index} "


@dataclass
class GatedReplica:
    id: str
    in_flight: int = 0
    served: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_gate(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HOLD_LIMIT):
                await self.gate.wait()


def build_app(replica: GatedReplica) -> Starlette:
    headers = {"x-backend-id": replica.id}

    async def completions(request: Request) -> Response:
        payload = await request.json()
        model = str(payload.get("model", "gated"))
        if not payload.get("stream"):
            replica.in_flight += 1
            try:
                await replica.wait_gate()
            finally:
                replica.in_flight -= 1
            replica.served += 1
            body = {
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "backend": replica.id,
            }
            return JSONResponse(body, headers=headers)

        async def events() -> AsyncIterator[str]:
            replica.in_flight += 1
            try:
                for index in range(STREAM_CHUNKS):
                    if index == STREAM_CHUNKS_BEFORE_GATE:
                        await replica.wait_gate()
                    chunk = {
                        "object": "chat.completion.chunk",
                        "model": model,
                        "choices": [{"index": 0, "delta": {"content": stream_piece(index)}}],
                        "backend": replica.id,
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                replica.in_flight -= 1
                replica.served += 1

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok", headers=headers)

    async def state(request: Request) -> Response:
        return JSONResponse(
            {"id": replica.id, "in_flight": replica.in_flight, "served": replica.served},
            headers=headers,
        )

    async def gate(request: Request) -> Response:
        if (await request.json())["open"]:
            replica.gate.set()
        else:
            replica.gate.clear()
        return JSONResponse({"id": replica.id, "open": replica.gate.is_set()}, headers=headers)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/state", state, methods=["GET"]),
            Route("/admin/gate", gate, methods=["POST"]),
        ]
    )


async def serve(count: int, id_prefix: str, host: str) -> None:
    replicas = [GatedReplica(f"{id_prefix}-{i}") for i in range(count)]
    for replica in replicas:
        replica.gate.set()
    group = ServerGroup([build_app(replica) for replica in replicas], host, graceful_shutdown=1)
    if await group.start():
        group.announce([replica.id for replica in replicas])
    await group.wait()


# --------------------------------------------------------------------------- Python API


class GatedBackend:
    """`python -m harness.gated_backend` as a child process, with its admin calls.

    It runs as a module from tests/: run as a script, its own directory would come first on
    the import path and the harness's `envoy` and `api` modules would shadow the packages.
    """

    def __init__(self, replicas: int, *, id_prefix: str, state_dir: Path) -> None:
        self.id_prefix = id_prefix
        self.log_path = state_dir / f"gated-{id_prefix}.log"
        self._stdout_path = state_dir / f"gated-{id_prefix}.out"
        argv = [sys.executable, "-m", "harness.gated_backend"]
        argv += ["--replicas", str(replicas), "--id-prefix", id_prefix]
        self._process = ManagedProcess(
            argv, self.log_path, stdout_path=self._stdout_path, cwd=Path(__file__).parent.parent
        )
        self.ports: dict[str, int] = {}
        """Replica id -> port, known once `start()` returns."""
        # One client for the admin calls: a new one per call builds an SSL context each time,
        # which a test polling in_flight() dozens of times pays for dearly on a loaded machine.
        self._admin = httpx.Client(timeout=5)

    def _read_announcement(self) -> bool:
        self.ports = read_announcement(self._stdout_path) or {}
        return bool(self.ports)

    def start(self, timeout: float = 30.0) -> Self:
        self._process.spawn()
        self._process.wait_for(self._read_announcement, timeout, "the replicas listen")
        return self

    def stop(self) -> None:
        self._process.stop(timeout=5.0)
        self._admin.close()

    def log_tail(self, lines: int = 40) -> str:
        return self._process.log_tail(lines)

    def _url(self, replica_id: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[replica_id]}{path}"

    def in_flight(self) -> dict[str, int]:
        """Replica id -> requests it holds right now."""
        return {
            replica_id: int(
                self._admin.get(self._url(replica_id, "/admin/state")).json()["in_flight"]
            )
            for replica_id in self.ports
        }

    def set_gate(self, open_: bool) -> None:
        """Close (hold new and waiting requests) or open (release them) every replica's gate."""
        for replica_id in self.ports:
            response = self._admin.post(self._url(replica_id, "/admin/gate"), json={"open": open_})
            response.raise_for_status()


T = TypeVar("T")


def hold_one_by_one(
    replicas: GatedBackend, count: int, send: Callable[[int], T]
) -> tuple[dict[str, int], list[T]]:
    """Close the replicas' gates and send `count` requests with ``send(index)``, one at a
    time, each once the last is held: Envoy knows every host's true count in flight when it
    places the next, so where they land depends on no timing. Then read where they are
    held and open the gates: (requests held per replica, each request's answer)."""
    replicas.set_gate(False)
    with ThreadPoolExecutor(max_workers=count) as executor:
        futures = []
        try:
            for index in range(count):
                futures.append(executor.submit(send, index))
                wait_until(
                    lambda held=index + 1: sum(replicas.in_flight().values()) == held,
                    60,
                    message=f"{index + 1} requests held by the replicas",
                )
            held = replicas.in_flight()
        finally:
            replicas.set_gate(True)
        return held, [future.result(timeout=600) for future in futures]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--id-prefix", default="g")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    asyncio.run(serve(args.replicas, args.id_prefix, args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
