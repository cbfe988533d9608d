"""What the probes that price an Envoy feature share (`bench.difficulty.luaprice`,
`bench.difficulty.sharerun`, `bench.regions.logprice`, `bench.cost.filterprice`,
`bench.controlplane.scale`): a stub upstream that answers every request at once, a process's
CPU time, the Envoy they run (kvpilot's static bootstrap of a fleet with an admin port and the
``kvpilot_signals`` cluster, one worker), kvpilot's access log service as the sink of its
logs, and timed requests.

The upstream is a separate Python process so that its work is not counted as Envoy's, and
answers at once so that Envoy's own work is most of a request's time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from google.protobuf import json_format

from compiler.plan import FleetPlan
from controlplane.local import find_binary
from xdsserver.arrivals import ArrivalBook
from xdsserver.difficultylog import ScoreBook
from xdsserver.signals import AccessLogServer, SignalBook
from xdsserver.static import static_bootstrap
from xdsserver.translate import translate
from xdsserver.usage import UsageBook

STUB_UPSTREAM = r"""
import asyncio, sys
BODY = b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
CHUNK = b'data: {"id":"x","model":"m","choices":[{"delta":{"content":"ok"}}]}\n\n'
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            if b'"stream": true' in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for piece in (CHUNK, CHUNK, b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
"""The upstream's program (``python -c STUB_UPSTREAM PORT``): a chat completion, or a
stream of two chunks when the body asks for one, on keep-alive connections."""


@contextlib.contextmanager
def stub_upstream(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """The stub upstream on ``127.0.0.1:port`` while the block runs."""
    process = subprocess.Popen(
        [sys.executable, "-c", STUB_UPSTREAM, str(port)], stdout=subprocess.DEVNULL
    )
    try:
        yield process
    finally:
        process.terminate()
        process.wait(10)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, seconds (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Timings:
    """One side's requests in a probe (with or without the feature priced)."""

    median_ms: float
    p99_ms: float
    """Of the time to the first chunk for a streamed request, to the end otherwise."""
    cpu_us_per_request: float
    """Envoy's CPU time over the side's blocks of requests, per request."""

    @classmethod
    def of(cls, seconds: Sequence[float], cpu: float) -> Timings:
        """From each request's time and Envoy's CPU seconds over them all."""
        return cls(
            median_ms=1000 * statistics.median(seconds),
            p99_ms=1000 * sorted(seconds)[int(0.99 * len(seconds))],
            cpu_us_per_request=1e6 * cpu / len(seconds),
        )


def probe_bootstrap(fleet: FleetPlan, signals: int, admin: int) -> dict[str, Any]:
    """kvpilot's static bootstrap of ``fleet`` as JSON, with the ``kvpilot_signals`` cluster
    (HTTP/2) at the log sink on ``127.0.0.1:signals`` and Envoy's admin on ``admin``."""
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


def alternating_blocks(
    conns: Mapping[str, http.client.HTTPConnection],
    pids: Mapping[str, int],
    body: bytes,
    requests: int,
    *,
    stream: bool,
) -> dict[str, Timings]:
    """The same request on every side's connection, `requests` per side after 50 to warm
    up, in blocks of up to 500 whose order of sides flips from one block to the next, so
    that every side sees the same machine; each side's times (to the first chunk of a
    streamed answer, to the end of another) and its Envoy's CPU (`pids`) over its blocks."""
    sides = list(conns)
    times: dict[str, list[float]] = {side: [] for side in sides}
    cpu = dict.fromkeys(sides, 0.0)
    for _ in range(50):
        for side in sides:
            timed_request(conns[side], body)
    block = max(1, min(500, requests // 4))
    for index in range(max(1, requests // block)):
        for side in sides if index % 2 == 0 else sides[::-1]:
            before = cpu_seconds(pids[side])
            for _ in range(block):
                answer = timed_request(conns[side], body)
                times[side].append(answer.first if stream else answer.total)
            cpu[side] += cpu_seconds(pids[side]) - before
    return {side: Timings.of(values, cpu[side]) for side, values in times.items()}


def both_answers(
    conns: Mapping[str, http.client.HTTPConnection],
    pids: Mapping[str, int],
    body: Callable[[bool], bytes],
    requests: int,
) -> dict[str, dict[str, Any]]:
    """`alternating_blocks` with JSON answers, then streamed ones (``body(stream)``): per kind
    of answer, each side's timings as JSON."""
    return {
        label: {
            side: asdict(timings)
            for side, timings in alternating_blocks(
                conns, pids, body(stream), requests, stream=stream
            ).items()
        }
        for label, stream in (("JSON", False), ("streamed", True))
    }


def probe_main(
    prog: str, measure: Callable[[int], Mapping[str, Any]], argv: list[str] | None
) -> int:
    """A probe's command line: ``--requests N`` (2,000 by default) and ``--out FILE``; prints
    what `measure` returns as JSON (and writes it to the file)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    text = json.dumps(measure(args.requests), indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


def start_log_sink(
    port: int,
    *,
    scores: ScoreBook | None = None,
    usage: UsageBook | None = None,
    arrivals: ArrivalBook | None = None,
) -> None:
    """kvpilot's access log service on ``127.0.0.1:port`` in a daemon thread of its own,
    filling the books given; returns once it listens."""
    ready = threading.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        AccessLogServer(
            SignalBook(lambda cluster, address, port: None),
            scores=scores,
            usage=usage,
            arrivals=arrivals,
        ).add_to(server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(10)


@contextlib.contextmanager
def envoy_process(config: Path, bootstrap: dict[str, Any]) -> Iterator[subprocess.Popen[bytes]]:
    """A real Envoy with one worker running ``bootstrap`` (written to ``config``) while the
    block runs; only errors are logged."""
    config.write_text(json.dumps(bootstrap))
    process = subprocess.Popen(
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
    try:
        yield process
    finally:
        process.terminate()
        process.wait(10)


class Answer(NamedTuple):
    """One timed request's answer."""

    first: float
    """Seconds to the first byte of the body: a stream's first event, a JSON answer's start."""
    total: float
    """Seconds to the end of the body."""
    body: bytes
    response: http.client.HTTPResponse
    """Read to its end; its headers are still there."""


def timed_request(conn: http.client.HTTPConnection, body: bytes) -> Answer:
    """POST ``body`` to the chat completions path and read the answer to its end. A status
    other than 200 is a `RuntimeError`."""
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    head = response.read(1)
    first = time.perf_counter() - start
    rest = response.read()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")
    return Answer(first, time.perf_counter() - start, head + rest, response)


def connect(port: int, body: bytes, within: float = 30) -> http.client.HTTPConnection:
    """A keep-alive connection to the listener on ``127.0.0.1:port`` once a request with
    ``body`` is answered through it (Envoy starting); gives up after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            timed_request(conn, body)
            return conn
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
