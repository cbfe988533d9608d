"""A paid provider stand-in for the overflow end-to-end tests, its pool, the overflow
route entries an Envoy holds, and the owned replicas' telemetry as an agent writes it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from harness.builders import pool
from harness.rig import Rig


class PaidStandIn:
    """An OpenAI-ish provider on its own thread: answers 200 with ``x-backend-id: <name>``,
    or, while ``retry_after`` is set, 429 with that Retry-After. Counts what it was sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hits = 0
        self.refused = 0
        self.retry_after: str | None = None
        self.first_429: float | None = None
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                stand_in.hits += 1
                limited = stand_in.retry_after
                if limited is not None:
                    stand_in.refused += 1
                    if stand_in.first_429 is None:
                        stand_in.first_429 = time.monotonic()
                    body = {"error": {"message": "rate limited", "type": "rate_limit_error"}}
                    self._send(429, body, {"retry-after": limited})
                    return
                self._send(200, {"object": "chat.completion"}, {})

            def do_GET(self) -> None:
                self._send(200, {"status": "ok"}, {})

            def _send(self, status: int, body: Any, headers: dict[str, str]) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("x-backend-id", stand_in.name)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]


@contextlib.contextmanager
def paid_stand_in(name: str) -> Iterator[PaidStandIn]:
    stand_in = PaidStandIn(name)
    threading.Thread(target=stand_in.server.serve_forever, daemon=True).start()
    try:
        yield stand_in
    finally:
        stand_in.server.shutdown()
        stand_in.server.server_close()


def paid_pool(name: str, port: int) -> dict[str, Any]:
    """A paid pool: the stand-in by DNS name, so it is an external provider."""
    return pool(
        name, [], endpoints=[{"address": "localhost", "port": port}], healthCheck={"enabled": False}
    )


def overflow_entries(rig: Rig) -> dict[str, tuple[str, int]]:
    """Envoy's overflow route entries now: name -> (cluster, share in millionths)."""
    dump = rig.envoy.config_dump()
    out = {}
    for config in dump["configs"]:
        for dynamic in config.get("dynamic_route_configs", []):
            for vhost in dynamic["route_config"].get("virtual_hosts", []):
                for route in vhost.get("routes", []):
                    if route["name"].endswith("/overflow"):
                        fraction = route["match"]["runtime_fraction"]["default_value"]
                        out[route["name"]] = (
                            route["route"]["cluster"],
                            int(fraction.get("numerator", 0)),
                        )
    return out


def put_fill(
    etcd: EmbeddedEtcd, prefix: str, ports: list[int], fill: float, *, slots: int = 8
) -> None:
    """Every owned replica's record, as `kvpilot agent --max-running 8` (`slots`) would write
    it, at a batch fill of `fill` ((running + waiting) / slots)."""

    async def put() -> None:
        client = EtcdClient([etcd.endpoint])
        await client.connect()
        try:
            store = Store(client, prefix)
            running = min(float(slots), slots * fill)
            for port in ports:
                record = {
                    "at": time.time(),
                    "running": running,
                    "waiting": slots * fill - running,
                    "max_running": slots,
                }
                await store.put_telemetry("owned", f"127.0.0.1:{port}", record)
        finally:
            await client.close()

    asyncio.run(put())
