"""The declarative objects tests send: pools, routing policies and their routes, fleets,
rollouts, and the chat requests replicas answer. One builder per kind; a test passes what it
cares about and gets the same plain dict the REST API takes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

API_VERSION = "kvpilot.io/v1"
FAST_HEALTH_CHECK = "500ms"
"""A health-check interval that keeps start-up quick and shows failover within a second."""


def pool(
    name: str = "chat",
    ports: Iterable[int] = (8001, 8002),
    *,
    models: Iterable[str] = (),
    weights: Mapping[int, int] | None = None,
    health_check: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A Pool of replicas on 127.0.0.1 at `ports`.

    `weights` gives an endpoint weight per port (the others get 100); `health_check` an
    active health-check interval; other keyword arguments are further spec fields.
    """
    endpoints: list[dict[str, Any]] = []
    for port in ports:
        endpoint: dict[str, Any] = {"address": "127.0.0.1", "port": port}
        if weights is not None:
            endpoint["weight"] = weights.get(port, 100)
        endpoints.append(endpoint)
    body: dict[str, Any] = {"models": list(models), "endpoints": endpoints}
    if health_check is not None:
        body["healthCheck"] = {"interval": health_check}
    return {
        "apiVersion": API_VERSION,
        "kind": "Pool",
        "metadata": {"name": name},
        "spec": {**body, **spec},
    }


def route(*pools: str, name: str = "all", **fields: Any) -> dict[str, Any]:
    """A route sending everything to one tier of `pools`; other keyword arguments are further
    route fields (balancing, sessionAffinity, retries, ...)."""
    return {"name": name, "tiers": [list(pools)], **fields}


def policy(
    name: str = "main",
    port: int = 10000,
    routes: Iterable[Mapping[str, Any]] | None = None,
    *,
    pools: Iterable[str] = ("chat",),
    fleets: Iterable[str] | None = None,
) -> dict[str, Any]:
    """A RoutingPolicy listening on 127.0.0.1:`port` with `routes` (by default one route to
    one tier of `pools`), for `fleets` when given (else the default fleet)."""
    spec: dict[str, Any] = {}
    if fleets is not None:
        spec["fleets"] = list(fleets)
    spec["listener"] = {"port": port, "address": "127.0.0.1"}
    spec["routes"] = [dict(r) for r in routes] if routes is not None else [route(*pools)]
    return {
        "apiVersion": API_VERSION,
        "kind": "RoutingPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def arrivals_overflow(ports: Iterable[int], **overflow: Any) -> tuple[dict[str, Any], ...]:
    """An owned pool of vLLM replicas at `ports`, a paid pool, and a policy whose route
    `chat` keeps sessions on the owned pool and overflows to the paid one by arrivals
    (`overflow`: more of the route's overflow fields)."""
    owned = pool("owned", ports, telemetry={"format": "vllm"})
    paid = pool(
        "paid",
        [],
        endpoints=[{"address": "localhost", "port": 9443}],
        healthCheck={"enabled": False},
    )
    chat = {
        "name": "chat",
        "tiers": [["owned"]],
        "sessionAffinity": {"header": "x-session-id"},
        "overflow": {"pools": ["paid"], "signal": "arrivals", **overflow},
    }
    return owned, paid, policy("main", 10000, [chat])


def fleet_policies(ports: Mapping[str, int]) -> list[dict[str, Any]]:
    """An empty pool `p` and, per fleet, a policy named after it that only that fleet gets,
    listening on the fleet's port: what tests of fleet scoping apply."""
    policies = [
        policy(name, port, [route("p", name="r")], fleets=[name]) for name, port in ports.items()
    ]
    return [pool("p", []), *policies]


def fleet(name: str = "default", **spec: Any) -> dict[str, Any]:
    """A Fleet with the given spec fields."""
    return {"apiVersion": API_VERSION, "kind": "Fleet", "metadata": {"name": name}, "spec": spec}


def rollout_steps(weights: Iterable[int], min_duration: float | str) -> list[dict[str, Any]]:
    """Rollout steps: one per canary weight, each held at least `min_duration`."""
    return [{"weight": weight, "minDuration": min_duration} for weight in weights]


def rollout(
    name: str = "canary",
    *,
    target: tuple[str, str] = ("main", "all"),
    stable: str = "chat",
    canary: str = "next",
    **spec: Any,
) -> dict[str, Any]:
    """A Rollout of `canary` beside `stable` on the (policy, route) `target`: by default a
    10% step held 30 s, then 100%, judged on the error rate; keyword arguments replace spec
    fields (steps, analysis, ...)."""
    policy_name, route_name = target
    return {
        "apiVersion": API_VERSION,
        "kind": "Rollout",
        "metadata": {"name": name},
        "spec": {
            "target": {"policy": policy_name, "route": route_name},
            "stable": stable,
            "canary": canary,
            "steps": [{"weight": 10, "minDuration": "30s"}, {"weight": 100}],
            "analysis": {"rules": [{"metric": "errorRate", "max": 0.02}]},
            **spec,
        },
    }


def service_classes(
    *middle: dict[str, Any], saturation: dict[str, Any] | None = None, **batch: Any
) -> dict[str, Any]:
    """A policy's serviceClasses: interactive (the default, never restricted), then `middle`,
    then batch, matched on `x-priority: batch` and given `batch`'s fields (whenSaturated,
    retryAfter, ...); `saturation` when given."""
    body: dict[str, Any] = {} if saturation is None else {"saturation": saturation}
    body["classes"] = [
        {"name": "interactive", "objective": {"ttft": "1s"}},
        *middle,
        {
            "name": "batch",
            "match": {"headers": [{"name": "x-priority", "value": "batch"}]},
            "objective": {"ttft": "60s"},
            **batch,
        },
    ]
    return body


def chat(model: str = "sim-model", content: str = "hi", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}
