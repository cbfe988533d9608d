"""What the arrivals log costs Envoy per request, measured with the real Envoy.

``python -m bench.regions.logprice [--requests N] [--out FILE]``

Two Envoys (one worker each) with kvpilot's own translation of a located fleet whose route
has replicas in its own region and another (so its listener carries the arrivals log,
``xdsserver.arrivals``), one of them with the log turned off, in front of a trivial upstream
that answers at once (Envoy's own work is most of the time). kvpilot's access log service
takes the entries into an ``ArrivalBook``, which also shows that Envoy 1.40 sends the start
entries with the cluster already chosen. Blocks of requests alternate between the Envoys, so
both see the same machine; Envoy's CPU time comes from ``/proc/<pid>/stat`` over each block.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from bench.rig.probe import cpu_seconds, stub_upstream
from compiler import compile_plan
from compiler.plan import FleetPlan
from controlplane.local import find_binary
from controlplane.local.process import free_port
from policies import parse_object
from signals import PolicyState
from xdsserver.arrivals import ArrivalBook
from xdsserver.signals import AccessLogServer, SignalBook
from xdsserver.static import static_bootstrap
from xdsserver.translate import translate


def _body(stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "small",
        "messages": [{"role": "user", "content": "Explain how the cache works and why."}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def _request(conn: http.client.HTTPConnection, body: bytes) -> tuple[float, float]:
    """(time to the first body byte, total time)."""
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    response.read(1)
    first = time.perf_counter() - start
    response.read()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")
    return first, time.perf_counter() - start


def _fleet(listener: int, backend: int) -> FleetPlan:
    """Fleet us-east: one replica at home, one (the same upstream, another address) away."""
    pool = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": "small"},
        "spec": {
            "models": ["small"],
            "endpoints": [
                {"address": "127.0.0.1", "port": backend, "locality": {"region": "us-east"}},
                {"address": "127.0.0.2", "port": backend, "locality": {"region": "eu-west"}},
            ],
            "healthCheck": {"enabled": False},
            "outlierDetection": {"enabled": False},
        },
    }
    fleet = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Fleet",
        "metadata": {"name": "us-east"},
        "spec": {"locality": {"region": "us-east"}, "accessLog": False},
    }
    policy = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "main"},
        "spec": {
            "fleets": ["us-east"],
            "listener": {"address": "127.0.0.1", "port": listener},
            "routes": [{"name": "small", "tiers": [["small"]]}],
        },
    }
    objects = [parse_object(pool), parse_object(fleet), parse_object(policy)]
    plan = compile_plan(PolicyState.from_objects(objects)).fleet("us-east")
    assert plan is not None
    return plan


def _bootstrap(fleet: FleetPlan, signals: int, admin: int) -> dict[str, Any]:
    bootstrap: dict[str, Any] = json.loads(
        json_format.MessageToJson(
            static_bootstrap(translate(fleet)), preserving_proto_field_name=True
        )
    )
    protocol = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    address = {"socket_address": {"address": "127.0.0.1", "port_value": signals}}
    bootstrap["static_resources"]["clusters"].append(
        {
            "name": "kvpilot_signals",
            "type": "STATIC",
            "typed_extension_protocol_options": {
                protocol: {
                    "@type": f"type.googleapis.com/{protocol}",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "kvpilot_signals",
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
            },
        }
    )
    bootstrap["admin"] = {
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}
    }
    return bootstrap


def _sink(port: int, book: ArrivalBook, ready: threading.Event) -> None:
    """kvpilot's access log service on ``port``, in a thread of its own."""

    async def serve() -> None:
        server = grpc.aio.server()
        AccessLogServer(SignalBook(lambda cluster, address, port: None), arrivals=book).add_to(
            server
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(serve())


def _connect(port: int) -> http.client.HTTPConnection:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            _request(conn, _body())
            return conn
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def measure(requests: int) -> dict[str, Any]:
    backend, signals = free_port(), free_port()
    book = ArrivalBook()
    ready = threading.Event()
    threading.Thread(target=_sink, args=(signals, book, ready), daemon=True).start()
    ready.wait(10)
    ports = {"without": free_port(), "with": free_port()}
    envoys: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory() as workdir, stub_upstream(backend):
        try:
            for kind, port in ports.items():
                fleet = _fleet(port, backend)
                assert fleet.listeners[0].arrivals_log
                if kind == "without":
                    listener = replace(fleet.listeners[0], arrivals_log=False)
                    fleet = replace(fleet, listeners=(listener,))
                config = Path(workdir) / f"envoy-{kind}.json"
                config.write_text(json.dumps(_bootstrap(fleet, signals, free_port())))
                envoys[kind] = subprocess.Popen(
                    [
                        str(find_binary("envoy")),
                        "-c",
                        str(config),
                        "--concurrency",
                        "1",
                        "--use-dynamic-base-id",
                        "-l",
                        "error",
                    ]
                )
            conns = {kind: _connect(port) for kind, port in ports.items()}
            results: dict[str, Any] = {}
            for label, stream in (("JSON", False), ("streamed", True)):
                body = _body(stream)
                times: dict[str, list[float]] = {kind: [] for kind in ports}
                cpu = dict.fromkeys(ports, 0.0)
                for _ in range(50):
                    for kind in ports:
                        _request(conns[kind], body)
                block = max(1, min(500, requests // 4))
                for index in range(max(1, requests // block)):
                    for kind in ("with", "without") if index % 2 else ("without", "with"):
                        before = cpu_seconds(envoys[kind].pid)
                        for _ in range(block):
                            first, total = _request(conns[kind], body)
                            times[kind].append(first if stream else total)
                        cpu[kind] += cpu_seconds(envoys[kind].pid) - before
                results[label] = {
                    kind: {
                        "median_ms": 1000 * statistics.median(values),
                        "p99_ms": 1000 * sorted(values)[int(0.99 * len(values))],
                        "cpu_us_per_request": 1e6 * cpu[kind] / len(values),
                    }
                    for kind, values in times.items()
                }
            time.sleep(1)  # the log's last batch
            results["entries"] = book.entries
            results["rates"] = book.rates()
            return results
        finally:
            for envoy in envoys.values():
                envoy.terminate()
                envoy.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.regions.logprice")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = json.dumps(measure(args.requests), indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
