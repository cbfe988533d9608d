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

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
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
from xdsserver.arrivals import ArrivalBook


def _body(stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "small",
        "messages": [{"role": "user", "content": "Explain how the cache works and why."}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


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


def measure(requests: int) -> dict[str, Any]:
    backend, signals = free_port(), free_port()
    book = ArrivalBook()
    start_log_sink(signals, arrivals=book)
    ports = {"without": free_port(), "with": free_port()}
    envoys: dict[str, subprocess.Popen[bytes]] = {}
    with (
        tempfile.TemporaryDirectory() as workdir,
        stub_upstream(backend),
        contextlib.ExitStack() as running,
    ):
        for kind, port in ports.items():
            fleet = _fleet(port, backend)
            assert fleet.listeners[0].arrivals_log
            if kind == "without":
                listener = replace(fleet.listeners[0], arrivals_log=False)
                fleet = replace(fleet, listeners=(listener,))
            config = Path(workdir) / f"envoy-{kind}.json"
            bootstrap = probe_bootstrap(fleet, signals, free_port())
            envoys[kind] = running.enter_context(envoy_process(config, bootstrap))
        conns = {kind: connect(port, _body()) for kind, port in ports.items()}
        pids = {kind: envoy.pid for kind, envoy in envoys.items()}
        results: dict[str, Any] = both_answers(conns, pids, _body, requests)
        time.sleep(1)  # the log's last batch
        results["entries"] = book.entries
        results["rates"] = book.rates()
        return results


def main(argv: list[str] | None = None) -> int:
    return probe_main("python -m bench.regions.logprice", measure, argv)


if __name__ == "__main__":
    sys.exit(main())
