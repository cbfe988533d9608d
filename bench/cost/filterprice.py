"""What the usage-accounting filter (``kvpilot.usage``) costs per request, measured with the
real Envoy.

``python -m bench.cost.filterprice [--requests N] [--clients N] [--chunk-loop] [--out FILE]``

Two Envoys (one worker each) with kvpilot's own translation of a policy that routes by model
to one simulated vLLM replica (``replicasim``, batching on, a 64-token answer streamed as an
SSE event every 20 ms or so), one of them with the accounting filter taken out of its chain
and otherwise the same config; with ``--chunk-loop`` a third whose filter only iterates the
response's chunks (what Envoy's Lua machinery costs before any scanning). Each prompt is
2,000 characters and starts with a number of its own, so no request finds another's prefix
in the replica's cache. ``--clients`` clients (8 by default) send at once, each starting a
little after the one before (`STAGGER`), so that the replica prefills one prompt at a time as
under steady traffic. Blocks of requests alternate between the Envoys, so every side sees the
same machine and the same batch, once streamed and once as JSON answers. The time to first token is the time to the
first byte of the body (for a JSON answer, about the whole answer); Envoy's CPU time comes
from ``/proc/<pid>/stat`` over each block. Each Envoy's usage log goes to a log service of
its own, which checks that the side with the filter counted every answer and the side
without it none.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.rig.jsonfields import known, without_none
from bench.rig.probe import (
    Timings,
    connect,
    cpu_seconds,
    envoy_process,
    probe_bootstrap,
    start_log_sink,
    timed_request,
)
from compiler import compile_plan
from compiler.plan import FleetPlan
from controlplane.local.process import free_port
from controlplane.local.replicas import BackendProcess
from policies import parse_object
from replicasim.simulator import SimConfig
from signals import PolicyState
from signals.spend import TokenPrice
from xdsserver.translate.usage import USAGE_FILTER
from xdsserver.usage import UsageBook

MODEL = "sim-model"
ANSWER_TOKENS = 64
PROMPT_CHARS = 2000
SIM = SimConfig(stream_interval=0.02)
"""The replica's engine: an ~8B model's step times, an SSE event at most every 20 ms."""
SIDES = ("without", "with_filter", "chunk_loop")
"""The Envoys: the filter taken out, kvpilot's config as it is, the filter's Lua replaced by
`CHUNK_LOOP`."""
STAGGER = 0.12
"""Seconds between one client's first request of a block and the next client's: 8 clients
spread over about one answer's time, so the replica prefills one prompt at a time, as under
steady traffic, rather than every client's at once in the same step."""
CHUNK_LOOP = """function envoy_on_response(handle)
  for chunk in handle:bodyChunks() do
  end
end
"""
"""A filter that resumes on every chunk of the response and does nothing with it."""
_ANSWERS = (("streamed", True), ("JSON", False))


@dataclass(frozen=True)
class AnswerCost:
    """Every side at one kind of answer (streamed or JSON)."""

    without: Timings
    """The filter taken out of the chain."""
    with_filter: Timings
    """kvpilot's config as it is."""
    events_per_response: float
    """SSE events a client got per streamed response through the filter (0 for JSON)."""
    chunk_loop: Timings | None = None
    """With ``--chunk-loop``: the filter's Lua only iterates the chunks."""

    def to_json(self) -> dict[str, Any]:
        return without_none(asdict(self), "chunk_loop")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AnswerCost:
        loop = data.get("chunk_loop")
        return cls(
            **known(cls, data, "without", "with_filter", "chunk_loop"),
            without=Timings(**data["without"]),
            with_filter=Timings(**data["with_filter"]),
            chunk_loop=Timings(**loop) if loop is not None else None,
        )


@dataclass(frozen=True)
class FilterPrice:
    """Both kinds of answer, how the run was made, and what each side's usage log counted."""

    requests: int
    """Measured requests per side and kind of answer."""
    clients: int
    """Requests in flight at once."""
    answers: dict[str, AnswerCost]
    """``streamed`` and ``JSON``."""
    answered: dict[str, int] = field(default_factory=dict)
    """Answers per side, warm-up included."""
    counted: dict[str, int] = field(default_factory=dict)
    """Answers per side whose usage reached kvpilot's log service: all of them with the
    filter, none without it."""

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "clients": self.clients,
            "answers": {label: cost.to_json() for label, cost in self.answers.items()},
            "answered": self.answered,
            "counted": self.counted,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FilterPrice:
        return cls(
            **known(cls, data, "answers"),
            answers={label: AnswerCost.from_json(c) for label, c in data["answers"].items()},
        )


class _Unpriced:
    """The usage books' view of the plan: no pool, no price, no tenant header (only whether
    an entry carried usage is read here)."""

    def pool(self, cluster: str, address: str, port: int) -> str | None:
        return None

    def price(self, pool: str) -> TokenPrice | None:
        return None

    def tenant_header(self, route: str) -> str:
        return ""


def accounting_fleet(listener: int, replica: int) -> FleetPlan:
    """A policy on ``listener`` routing model `MODEL` to the replica; the stdout access log
    off, so that Envoy's work is the proxying and the accounting."""
    pool = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": "sim"},
        "spec": {
            "models": [MODEL],
            "endpoints": [{"address": "127.0.0.1", "port": replica}],
            "healthCheck": {"enabled": False},
            "outlierDetection": {"enabled": False},
        },
    }
    fleet = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Fleet",
        "metadata": {"name": "probe"},
        "spec": {"accessLog": False},
    }
    policy = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "main"},
        "spec": {
            "fleets": ["probe"],
            "listener": {"address": "127.0.0.1", "port": listener},
            "routes": [{"name": "sim", "match": {"models": [MODEL]}, "tiers": [["sim"]]}],
        },
    }
    objects = [parse_object(pool), parse_object(fleet), parse_object(policy)]
    plan = compile_plan(PolicyState.from_objects(objects)).fleet("probe")
    assert plan is not None
    return plan


def side_bootstrap(side: str, fleet: FleetPlan, signals: int, admin: int) -> dict[str, Any]:
    """The bootstrap of one side: the accounting filter kept (``with_filter``), taken out of
    every listener's chain (``without``), or its Lua replaced by `CHUNK_LOOP` (``chunk_loop``).
    """
    if side not in SIDES:
        raise ValueError(f"side: {side!r} is none of {', '.join(SIDES)}")
    bootstrap = probe_bootstrap(fleet, signals, admin)
    found = 0
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network in chain["filters"]:
                filters = network.get("typed_config", {}).get("http_filters")
                if filters is None:
                    continue
                for http_filter in [f for f in filters if f["name"] == USAGE_FILTER]:
                    found += 1
                    if side == "without":
                        filters.remove(http_filter)
                    elif side == "chunk_loop":
                        source = http_filter["typed_config"]["default_source_code"]
                        source["inline_string"] = CHUNK_LOOP
    if found == 0:
        raise ValueError(f"no {USAGE_FILTER} filter in the translated listeners")
    return bootstrap


def _body(number: int, stream: bool) -> bytes:
    """A request of its own: a 2,000-character prompt that starts with ``number``."""
    text = f"{number} " + "Explain how the cache works and why it matters. " * 42
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": ANSWER_TOKENS,
        "messages": [{"role": "user", "content": text[:PROMPT_CHARS]}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def measure(
    requests: int, clients: int = 8, chunk_loop: bool = False, sim: SimConfig = SIM
) -> FilterPrice:
    """TTFT and Envoy CPU per request on every side, streamed and JSON; ``requests`` measured
    per side and kind of answer, ``clients`` at once, from a replica whose engine is
    ``sim``."""
    sides = SIDES if chunk_loop else SIDES[:2]
    numbers = itertools.count()
    books = {side: UsageBook(_Unpriced()) for side in sides}
    answered = dict.fromkeys(sides, 0)
    with (
        tempfile.TemporaryDirectory() as workdir,
        BackendProcess(1, model=MODEL, simulator=sim, state_dir=Path(workdir)) as replica,
        contextlib.ExitStack() as running,
    ):
        ports: dict[str, int] = {}
        envoys: dict[str, subprocess.Popen[bytes]] = {}
        for side in sides:
            ports[side], signals = free_port(), free_port()
            start_log_sink(signals, usage=books[side])
            fleet = accounting_fleet(ports[side], replica.replicas[0].port)
            bootstrap = side_bootstrap(side, fleet, signals, free_port())
            config = Path(workdir) / f"envoy-{side}.json"
            envoys[side] = running.enter_context(envoy_process(config, bootstrap))
        conns: dict[str, list[http.client.HTTPConnection]] = {
            side: [connect(ports[side], _body(next(numbers), False)) for _ in range(clients)]
            for side in sides
        }
        for side in sides:
            answered[side] += clients
        pool = running.enter_context(ThreadPoolExecutor(clients))

        def run(side: str, count: int, stream: bool) -> list[tuple[float, int]]:
            """``count`` requests on each client's connection to ``side`` at once: each
            one's time to first byte (JSON: to the end) and its SSE events."""

            def client(index: int) -> list[tuple[float, int]]:
                time.sleep(index * STAGGER)
                out = []
                for _ in range(count):
                    answer = timed_request(conns[side][index], _body(next(numbers), stream))
                    seconds = answer.first if stream else answer.total
                    out.append((seconds, answer.body.count(b"data:")))
                return out

            done = list(pool.map(client, range(clients)))
            answered[side] += count * clients
            return [sample for samples in done for sample in samples]

        # Each client's share of the requests, in up to four blocks per side: the order of
        # the sides flips from one block to the next.
        share = max(1, requests // clients)
        rounds = min(4, share)
        blocks = [share // rounds + (index < share % rounds) for index in range(rounds)]
        answers: dict[str, AnswerCost] = {}
        for label, stream in _ANSWERS:
            for side in sides:
                run(side, 2, stream)  # warm up
            times: dict[str, list[float]] = {side: [] for side in sides}
            cpu = dict.fromkeys(sides, 0.0)
            events: list[int] = []
            for index, count in enumerate(blocks):
                for side in sides if index % 2 == 0 else sides[::-1]:
                    before = cpu_seconds(envoys[side].pid)
                    samples = run(side, count, stream)
                    cpu[side] += cpu_seconds(envoys[side].pid) - before
                    times[side] += [seconds for seconds, _ in samples]
                    if side == "with_filter":
                        events += [n for _, n in samples]
            timings = {side: Timings.of(times[side], cpu[side]) for side in sides}
            answers[label] = AnswerCost(
                without=timings["without"],
                with_filter=timings["with_filter"],
                events_per_response=sum(events) / len(events) if stream else 0.0,
                chunk_loop=timings.get("chunk_loop"),
            )
        return FilterPrice(share * clients, clients, answers, answered, _counted(books, answered))


def _counted(books: Mapping[str, UsageBook], answered: Mapping[str, int]) -> dict[str, int]:
    """Each side's answers that carried usage to its log service, once every answer's entry
    has arrived (Envoy sends them every 0.1 s) or 10 s have passed."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(b.entries + b.without_usage >= answered[s] for s, b in books.items()):
            break
        time.sleep(0.1)
    return {side: book.entries for side, book in books.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cost.filterprice")
    parser.add_argument(
        "--requests", type=int, default=600, help="per side and kind of answer; default 600"
    )
    parser.add_argument("--clients", type=int, default=8, help="at once; default 8")
    parser.add_argument(
        "--chunk-loop", action="store_true", help="a third Envoy whose filter only iterates"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.clients < 1:
        parser.error("--requests and --clients must be at least 1")
    text = json.dumps(measure(args.requests, args.clients, args.chunk_loop).to_json(), indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
