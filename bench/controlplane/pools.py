"""The control-plane benchmark's configuration: `endpoints` static endpoints in pools of at most
500, and one routing policy with a route (so a cluster) per pool."""

from __future__ import annotations

from typing import Any

POLICY = "bench"
"""The routing policy's name: its clusters are bench/r0, bench/r1, ..."""
FLEET = "default"
"""The fleet (Envoy `node.cluster`) every Envoy and simulated stream joins."""


def pools_and_policy(
    endpoints: int, listener_port: int, *, balancing: str = ""
) -> list[tuple[str, dict[str, Any]]]:
    """REST path -> body: `endpoints` static endpoints spread over pools of at most 500, and one
    policy with a route (so a cluster) per pool, balanced by `balancing` (the default when
    empty). Nothing listens on the endpoints and nothing is sent to them: health checks are off
    (on, 10 Envoys would probe 10,000 hosts and measure their own probing, not the change), and
    the addresses are loopback ones, so a stray connection stays on this machine."""
    per_pool = 500
    count = max(1, -(-endpoints // per_pool))
    objects: list[tuple[str, dict[str, Any]]] = []
    routes = []
    for p in range(count):
        size = min(per_pool, endpoints - p * per_pool) if endpoints > 1 else 1
        spec = {
            "models": [f"model-{p}"],
            "endpoints": [
                {"address": f"127.{1 + p // 250}.{p % 250}.{e // 250}", "port": 8000 + e % 250}
                for e in range(size)
            ],
            "healthCheck": {"enabled": False},
        }
        name = f"p{p}"
        objects.append((f"/v1/pools/{name}", _envelope("Pool", name, spec)))
        route: dict[str, Any] = {
            "name": f"r{p}",
            "match": {"models": [f"model-{p}"]},
            "tiers": [[name]],
        }
        if balancing:
            route["balancing"] = balancing
        routes.append(route)
    spec = {"listener": {"address": "127.0.0.1", "port": listener_port}, "routes": routes}
    objects.append((f"/v1/routingpolicies/{POLICY}", _envelope("RoutingPolicy", POLICY, spec)))
    return objects


def _envelope(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.io/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}


def rebuild_input(endpoints: int) -> dict[str, Any]:
    """The state of the in-process rebuilds: etcd key (relative to the prefix) -> value."""
    state = {}
    for path, body in pools_and_policy(endpoints, 10000):
        kind, name = path.removeprefix("/v1/").split("/")
        state[f"objects/{kind}/{name}"] = body
    return state
