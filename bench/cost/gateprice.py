"""What a route's gate (``overflow.maxInFlight``) costs Envoy per request, measured with the
real Envoy.

``python -m bench.cost.gateprice [--requests N] [--out FILE]``

Two Envoys (one worker each) with kvpilot's own translation of the same route with overflow,
one of them with a gate whose limit is never reached, in front of a trivial upstream that
answers at once (Envoy's own work is most of the time): the gated side's requests take the
gate's second HTTP pass through an internal listener, and nothing else differs. Blocks of
requests alternate between the two, so both see the same machine; Envoy's CPU time comes from
``/proc/<pid>/stat`` over each block. The usage log's book checks that the gated side's
answers are counted under the replicas' pool, as the direct side's are.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.rig.probe import (
    both_answers,
    connect,
    envoy_process,
    probe_bootstrap,
    probe_main,
    start_log_sink,
    stub_upstream,
)
from compiler import compile_plan
from compiler.plan import FleetPlan
from controlplane.local.process import free_port
from policies import parse_object
from signals import PolicyState

SIDES = ("direct", "gated")
LIMIT = 10_000
"""The gated side's ``maxInFlight``: never reached by one client."""


def _body(stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "small",
        "messages": [{"role": "user", "content": "Explain how the cache works and why."}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def gate_fleet(listener: int, backend: int, *, gated: bool) -> FleetPlan:
    """A route to one replica (the upstream) with a paid pool for overflow (never used), with
    a gate at `LIMIT` or without one."""
    pools = [
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Pool",
            "metadata": {"name": "small"},
            "spec": {
                "models": ["small"],
                "endpoints": [{"address": "127.0.0.1", "port": backend}],
                "healthCheck": {"enabled": False},
                "outlierDetection": {"enabled": False},
            },
        },
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Pool",
            "metadata": {"name": "paid"},
            "spec": {
                "models": ["small"],
                "endpoints": [{"address": "localhost", "port": backend}],
                "healthCheck": {"enabled": False},
            },
        },
    ]
    fleet = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Fleet",
        "metadata": {"name": "probe"},
        "spec": {"accessLog": False},
    }
    overflow: dict[str, Any] = {"pools": ["paid"], "signal": "fill"}
    if gated:
        overflow["maxInFlight"] = LIMIT
    policy = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "main"},
        "spec": {
            "fleets": ["probe"],
            "listener": {"address": "127.0.0.1", "port": listener},
            "routes": [
                {
                    "name": "small",
                    "tiers": [["small"]],
                    "sessionAffinity": {"header": "x-session-id"},
                    "overflow": overflow,
                }
            ],
        },
    }
    objects = [parse_object(o) for o in (*pools, fleet, policy)]
    plan = compile_plan(PolicyState.from_objects(objects)).fleet("probe")
    assert plan is not None
    return plan


def measure(requests: int) -> dict[str, Any]:
    """Time to the first byte (streamed) or the end (JSON) and Envoy's CPU per request on
    each side, `requests` per side and kind of answer."""
    backend = free_port()
    ports = {side: free_port() for side in SIDES}
    envoys: dict[str, subprocess.Popen[bytes]] = {}
    with (
        tempfile.TemporaryDirectory() as workdir,
        stub_upstream(backend),
        contextlib.ExitStack() as running,
    ):
        for side, port in ports.items():
            signals = free_port()
            start_log_sink(signals)
            fleet = gate_fleet(port, backend, gated=side == "gated")
            config = Path(workdir) / f"envoy-{side}.json"
            bootstrap = probe_bootstrap(fleet, signals, free_port())
            envoys[side] = running.enter_context(envoy_process(config, bootstrap))
        conns = {side: connect(port, _body()) for side, port in ports.items()}
        pids = {side: envoy.pid for side, envoy in envoys.items()}
        return both_answers(conns, pids, _body, requests)


def main(argv: list[str] | None = None) -> int:
    return probe_main("python -m bench.cost.gateprice", measure, argv)


if __name__ == "__main__":
    sys.exit(main())
