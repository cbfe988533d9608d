"""What a virtual model's Lua scorer costs per request, measured with the real Envoy.

``python -m bench.difficulty.luaprice [--requests N] [--external [--budget SECONDS]] [--out FILE]``

One Envoy (one worker) with kvpilot's own translation of a policy that has a virtual model
(built-in scorer) beside its two target models, a trivial upstream that answers at once (so
Envoy's own work is most of the time), and kvpilot's access log service as the score log's
sink. Requests alternate between the virtual model and its small target by name, with the
same body otherwise, so both see the same machine; Envoy's CPU time comes from
``/proc/<pid>/stat`` over each half. Bodies of 0.1, 4 and 64 KB, and a streamed request whose
time to the first chunk is measured.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from bench.rig.probe import cpu_seconds, stub_upstream
from bench.rig.virtualmodel import virtual_model_objects
from compiler import compile_plan
from controlplane.local import find_binary
from controlplane.local.process import free_port
from policies import parse_object
from signals import PolicyState
from xdsserver.difficultylog import ScoreBook
from xdsserver.signals import AccessLogServer, SignalBook
from xdsserver.static import static_bootstrap
from xdsserver.translate import translate

SCORER = r"""
import asyncio, sys
ANSWER = b'{"score": 0.1}'
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            await asyncio.sleep(float(sys.argv[2]))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
"""A stand-in classifier that answers after ``argv[2]`` seconds."""


def _policy(listener: int, backend: int, scorer: dict[str, Any] | None = None) -> list[Any]:
    virtual = {"name": "auto", "share": None, "cap": 100, **({"scorer": scorer} if scorer else {})}
    objects = virtual_model_objects(
        listener,
        backend,
        small="small",
        large="large",
        virtual=virtual,
        pool_spec={"outlierDetection": {"enabled": False}},
    )
    return [parse_object(body) for body in objects]


def _bootstrap(
    listener: int, backend: int, signals: int, admin: int, scorer: dict[str, Any] | None = None
) -> dict[str, Any]:
    plan = compile_plan(PolicyState.from_objects(_policy(listener, backend, scorer)))
    bootstrap: dict[str, Any] = json.loads(
        json_format.MessageToJson(
            static_bootstrap(translate(plan.fleets[0])), preserving_proto_field_name=True
        )
    )
    bootstrap["static_resources"]["clusters"].append(
        {
            "name": "kvpilot_signals",
            "type": "STATIC",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "kvpilot_signals",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": signals,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
    )
    bootstrap["admin"] = {
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}
    }
    return bootstrap


def _sink(port: int, book: ScoreBook, ready: threading.Event) -> None:
    """kvpilot's access log service on ``port``, in a thread of its own."""

    async def serve() -> None:
        server = grpc.aio.server()
        AccessLogServer(SignalBook(lambda cluster, address, port: None), scores=book).add_to(server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(serve())


def _body(model: str, size: int, stream: bool = False) -> bytes:
    text = ("Explain how the cache works and why. " * (size // 36 + 1))[:size]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def _request(conn: http.client.HTTPConnection, body: bytes) -> tuple[float, float, str]:
    """(time to the first body byte, total time, the answering model header)."""
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    response.read(1)
    first = time.perf_counter() - start
    response.read()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")
    return first, time.perf_counter() - start, response.getheader("x-kvpilot-model") or ""


@dataclass(frozen=True)
class PathCost:
    """One path's requests (straight to the small model, or through the virtual model)."""

    median_ms: float
    p99_ms: float
    """Of the time to the first chunk for a streamed request, to the end otherwise."""
    cpu_us_per_request: float
    """Envoy's CPU time over the path's blocks of requests, per request."""


@dataclass(frozen=True)
class SizeCost:
    """Both paths at one body size."""

    direct: PathCost
    virtual: PathCost
    over_budget_percent: float | None = None
    """With a budget: the percent of virtual requests slower than the direct median plus it."""


@dataclass(frozen=True)
class LuaPrice:
    """Both paths at every body size, and how many scores the log sink received."""

    sizes: dict[str, SizeCost]
    scores_logged: float

    def to_json(self) -> dict[str, Any]:
        """The sizes by label, ``scores_logged`` beside them."""
        return {label: size_json(cost) for label, cost in self.sizes.items()} | {
            "scores_logged": self.scores_logged
        }


def size_json(cost: SizeCost) -> dict[str, Any]:
    """One size's paths, and its over-budget percent where a budget was given."""
    out = asdict(cost)
    if cost.over_budget_percent is None:
        del out["over_budget_percent"]
    return out


def measure(
    requests: int, scorer: dict[str, Any] | None = None, budget: float | None = None
) -> LuaPrice:
    """Latency and Envoy CPU, direct and through the virtual model; with ``budget``, also the
    percent of virtual requests whose time exceeded the direct median plus the budget."""
    backend, listener, signals, admin = free_port(), free_port(), free_port(), free_port()
    book = ScoreBook()
    ready = threading.Event()
    threading.Thread(target=_sink, args=(signals, book, ready), daemon=True).start()
    ready.wait(10)
    with tempfile.TemporaryDirectory() as workdir, stub_upstream(backend):
        config = Path(workdir) / "envoy.json"
        config.write_text(json.dumps(_bootstrap(listener, backend, signals, admin, scorer)))
        envoy = subprocess.Popen(
            [
                str(find_binary("envoy")),
                "-c",
                str(config),
                "--concurrency",
                "1",
                "--use-dynamic-base-id",
                "-l",
                "error",
            ],
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", listener, timeout=10)
                    _request(conn, _body("small", 100))
                    break
                except (OSError, RuntimeError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            results: dict[str, SizeCost] = {}
            sizes = (
                (("0.1 KB", 100, False),)
                if scorer
                else (
                    ("0.1 KB", 100, False),
                    ("4 KB", 4096, False),
                    ("64 KB", 65536, False),
                    ("0.1 KB streamed", 100, True),
                )
            )
            for label, size, stream in sizes:
                times: dict[str, list[float]] = {"direct": [], "virtual": []}
                cpu = {"direct": 0.0, "virtual": 0.0}
                bodies = {
                    "direct": _body("small", size, stream),
                    "virtual": _body("auto", size, stream),
                }
                for _ in range(50):  # warm up both paths
                    for kind in bodies:
                        _request(conn, bodies[kind])
                block = max(1, min(500, requests // 4))
                for index in range(max(1, requests // block)):
                    for kind in ("direct", "virtual") if index % 2 else ("virtual", "direct"):
                        before = cpu_seconds(envoy.pid)
                        for _ in range(block):
                            first, total, model = _request(conn, bodies[kind])
                            times[kind].append(first if stream else total)
                            if kind == "virtual" and model not in ("small", "large"):
                                raise RuntimeError(f"virtual model answered by {model!r}")
                        cpu[kind] += cpu_seconds(envoy.pid) - before
                paths = {
                    kind: PathCost(
                        median_ms=1000 * statistics.median(values),
                        p99_ms=1000 * sorted(values)[int(0.99 * len(values))],
                        cpu_us_per_request=1e6 * cpu[kind] / len(values),
                    )
                    for kind, values in times.items()
                }
                over: float | None = None
                if budget is not None:
                    limit = statistics.median(times["direct"]) + budget
                    exceeded = sum(value > limit for value in times["virtual"])
                    over = 100 * exceeded / len(times["virtual"])
                results[label] = SizeCost(paths["direct"], paths["virtual"], over)
            time.sleep(1)  # the score log's last batch
            logged = sum(
                sample.value
                for metric in book.requests.collect()
                for sample in metric.samples
                if sample.name.endswith("_total")
            )
            return LuaPrice(results, logged)
        finally:
            envoy.terminate()
            envoy.wait(10)


def external(requests: int, timeout: float = 0.05) -> dict[str, SizeCost]:
    """Latency added by an external classifier that is quick, slower than its budget
    (``timeout``), or down: the fallback should cost at most the budget."""
    out: dict[str, SizeCost] = {}
    for label, delay in (("quick (1 ms)", 0.001), ("slow (1 s)", 1.0), ("down", None)):
        port = free_port()
        process = (
            subprocess.Popen([sys.executable, "-c", SCORER, str(port), str(delay)])
            if delay is not None
            else None
        )
        try:
            time.sleep(0.5)
            scorer = {
                "type": "external",
                "external": {"url": f"http://127.0.0.1:{port}/score", "timeout": timeout},
            }
            out[label] = measure(requests, scorer, timeout).sizes["0.1 KB"]
        finally:
            if process is not None:
                process.terminate()
                process.wait(10)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.difficulty.luaprice")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--external", action="store_true", help="the external classifier")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.05,
        help="the classifier's budget (the policy's timeout), seconds; default 0.05",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.external:
        costs = external(args.requests, args.budget)
        results = {"budget_ms": 1000 * args.budget} | {
            label: size_json(cost) for label, cost in costs.items()
        }
    else:
        results = measure(args.requests).to_json()
    text = json.dumps(results, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
