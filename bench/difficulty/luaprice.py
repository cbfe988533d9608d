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
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.rig.probe import (
    Timings,
    connect,
    cpu_seconds,
    envoy_process,
    probe_bootstrap,
    start_log_sink,
    stub_upstream,
    timed_request,
)
from bench.rig.virtualmodel import virtual_model_objects
from compiler import compile_plan
from controlplane.local.process import free_port
from policies import parse_object
from signals import PolicyState
from xdsserver.difficultylog import ScoreBook

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
    return probe_bootstrap(plan.fleets[0], signals, admin)


def _body(model: str, size: int, stream: bool = False) -> bytes:
    text = ("Explain how the cache works and why. " * (size // 36 + 1))[:size]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


@dataclass(frozen=True)
class SizeCost:
    """Both paths at one body size."""

    direct: Timings
    """Straight to the small model."""
    virtual: Timings
    """Through the virtual model."""
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
    start_log_sink(signals, scores=book)
    with tempfile.TemporaryDirectory() as workdir, stub_upstream(backend):
        bootstrap = _bootstrap(listener, backend, signals, admin, scorer)
        with envoy_process(Path(workdir) / "envoy.json", bootstrap) as envoy:
            conn = connect(listener, _body("small", 100))
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
                        timed_request(conn, bodies[kind])
                block = max(1, min(500, requests // 4))
                for index in range(max(1, requests // block)):
                    for kind in ("direct", "virtual") if index % 2 else ("virtual", "direct"):
                        before = cpu_seconds(envoy.pid)
                        for _ in range(block):
                            answer = timed_request(conn, bodies[kind])
                            model = answer.response.getheader("x-kvpilot-model") or ""
                            times[kind].append(answer.first if stream else answer.total)
                            if kind == "virtual" and model not in ("small", "large"):
                                raise RuntimeError(f"virtual model answered by {model!r}")
                        cpu[kind] += cpu_seconds(envoy.pid) - before
                paths = {kind: Timings.of(values, cpu[kind]) for kind, values in times.items()}
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
