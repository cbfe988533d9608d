"""The scenario suite's fleets: one policy's simulated replicas, its pool and listener, and
what the suite asks of them (serve, go idle, take a scenario's speed and cache, report
kvpilot's weights and the engines' metrics)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.rig.loadgen import parse_metrics
from bench.rig.routes import Policy
from bench.rig.stack import MODEL
from bench.routing.scenarios import Scenario
from controlplane.local.replicas import BackendProcess, ReplicaInfo
from replicasim.simulator import SimConfig


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Fleet:
    """One policy's replicas, listener and (per run) pool."""

    policy: Policy
    backends: BackendProcess
    port: int
    pool: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    @property
    def replicas(self) -> list[ReplicaInfo]:
        return self.backends.replicas

    @property
    def telemetry(self) -> bool:
        return self.policy.route.get("balancing") == "telemetry"


MAX_AGE_INTERVALS = 5
"""The pool's telemetry ``maxAge`` in the agent's scrape intervals (at least 5 s). The bench
starts its agents with a refresh of 3 intervals, so a record that nothing moved is written
again at most about 4 intervals after the last: a ``maxAge`` shorter than that lets records
go stale between refreshes, and a stale record resets a learned capacity weight to the
static one (at batch size 128 the interval is 2.4 s and a fixed 5 s did just that)."""


def telemetry_max_age(agent_interval: float) -> float:
    """Seconds a fleet's telemetry stays fresh when its agent scrapes every
    `agent_interval` wall-clock seconds."""
    return max(5.0, MAX_AGE_INTERVALS * agent_interval)


def pool_body(
    fleet: Fleet, scenario: Scenario | None = None, *, agent_interval: float = 1.0
) -> dict[str, Any]:
    """The fleet's pool; a ``weights_by_speed`` policy's endpoints weighted by the
    scenario's true speeds (100 for a full-speed replica); telemetry fresh for
    `telemetry_max_age` of the agent's interval."""

    def weight(index: int) -> dict[str, int]:
        if scenario is None or not fleet.policy.weights_by_speed:
            return {}
        return {"weight": max(1, round(100 / scenario.slow_of(index)))}

    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": fleet.pool},
        "spec": {
            "models": [MODEL],
            # Named alike in every fleet: each ring places replica i at the same points, so
            # every policy sends a session to the same replica index and fleets compare.
            "endpoints": [
                {"address": r.host, "port": r.port, "name": f"replica-{index}", **weight(index)}
                for index, r in enumerate(fleet.replicas)
            ],
            "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
            "telemetry": {
                "format": "vllm",
                "maxAge": f"{telemetry_max_age(agent_interval):g}s",
            },
        },
    }


def policy_body(fleet: Fleet) -> dict[str, Any]:
    route = {"name": "llm", "match": {"pathPrefix": "/v1/"}, "tiers": [[fleet.pool]]}
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": f"bench-{fleet.policy.key.replace('_', '-')}"},
        "spec": {
            "listener": {"address": "127.0.0.1", "port": fleet.port},
            "routes": [{**route, **fleet.policy.route}],
        },
    }


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def serves(fleet: Fleet) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    response = httpx.post(fleet.url, json=body, timeout=10.0)
    return response.status_code == 200 and response.headers.get("x-backend-id", "").startswith(
        fleet.policy.key + "-"
    )


def kvpilot_weights(api_url: str, pool: str) -> dict[str, float]:
    """kvpilot's telemetry weights for `pool`, by endpoint."""
    out = {}
    for line in httpx.get(f"{api_url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith("kvpilot_telemetry_weight{") and f'pool="{pool}"' in line:
            name, _, value = line.rpartition(" ")
            out[name.split('endpoint="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def bound_changes(api_url: str) -> dict[str, float]:
    """kvpilot's count of bounded-load changes (route updates to another twin) per telemetry
    route with session affinity: a capacity-bound route's rungs, or the fixed bounds'
    switches between the usual and the saturated twin."""
    out = {}
    for line in httpx.get(f"{api_url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith("kvpilot_bounded_load_changes_total{"):
            name, _, value = line.rpartition(" ")
            out[name.split('route="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def replica_metrics(fleet: Fleet) -> dict[str, dict[str, float]]:
    return {
        r.id: parse_metrics(httpx.get(f"{r.url}/metrics", timeout=5.0).text) for r in fleet.replicas
    }


def idle(fleet: Fleet) -> bool:
    return all(
        m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
        for m in replica_metrics(fleet).values()
    )


async def admin(
    url: str, path: str, body: dict[str, Any], client: httpx.AsyncClient | None = None
) -> None:
    if client is not None:
        (await client.post(f"{url}{path}", json=body, timeout=30.0)).raise_for_status()
        return
    async with httpx.AsyncClient(timeout=10.0) as own:
        (await own.post(f"{url}{path}", json=body)).raise_for_status()


async def prepare(fleet: Fleet, scenario: Scenario, sim: SimConfig, prompts: list[str]) -> None:
    """Give every replica the scenario's speed and cache, holding the shared system prompts
    (put in its cache directly: a fleet in service holds them, and serving them as requests
    took half a minute of wall time per run on a loaded machine)."""
    preload = [{"messages": [{"role": "system", "content": prompt}]} for prompt in prompts]
    # One client for the fleet: a client each costs a TLS context, a second on a busy machine.
    async with httpx.AsyncClient() as client:
        for index, replica in enumerate(fleet.replicas):
            blocks = max(1, round(sim.kv_blocks * scenario.kv_of(index)))
            reset = {"kv_blocks": blocks, "preload": preload}
            await admin(replica.url, "/admin/reset", reset, client)
            await admin(replica.url, "/admin/slow", {"factor": scenario.slow_of(index)}, client)
