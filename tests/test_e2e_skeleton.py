"""The walking skeleton, end to end: REST API -> etcd -> kvpilot -> ADS -> Envoy -> replicas.

Real etcd, a real `kvpilot serve` process, a real Envoy and simulated replicas; the
assertions are on which replica answered requests sent through Envoy, before and after
changes made through the REST API.
"""

from __future__ import annotations

import collections
from typing import Any

import httpx
import pytest
from conftest import ADMIN_TOKEN
from util import wait_until

from controlplane.launchers import EmbeddedEnvoy, free_port

pytestmark = pytest.mark.e2e

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def pool(name: str, ports: list[int], weights: dict[int, int] | None = None) -> dict[str, Any]:
    weights = weights or {}
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": name},
        "spec": {
            "models": ["sim-model"],
            "endpoints": [
                {"address": "127.0.0.1", "port": port, "weight": weights.get(port, 100)}
                for port in ports
            ],
        },
    }


def policy(name: str, pool_name: str, listener_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": name},
        "spec": {
            "listener": {"port": listener_port, "address": "127.0.0.1"},
            "routes": [
                {"name": "all", "balancing": "round_robin", "tiers": [[pool_name]]},
            ],
        },
    }


def served_by(url: str, count: int) -> collections.Counter[str]:
    """Which replica answered each of `count` requests sent through Envoy."""
    counts: collections.Counter[str] = collections.Counter()
    with httpx.Client(timeout=10) as client:
        for index in range(count):
            response = client.post(
                url,
                json={"model": "sim-model", "messages": [{"role": "user", "content": str(index)}]},
            )
            counts[response.headers.get("x-backend-id", f"status-{response.status_code}")] += 1
    return counts


def endpoint_weights(envoy: EmbeddedEnvoy, cluster: str) -> dict[int, int]:
    """Port -> weight of the endpoints Envoy has for `cluster` (admin /clusters)."""
    weights = {}
    for line in envoy.clusters().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == "weight":
            weights[int(parts[1].rsplit(":", 1)[1])] = int(parts[3])
    return weights


def test_traffic_through_envoy_follows_changes_made_through_the_api(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    replicas = backends(3, id_prefix="be")
    ports = [replica.port for replica in replicas.replicas]
    ids = {replica.port: replica.id for replica in replicas.replicas}
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port, fleet="default")
    listener_port = free_port()
    url = f"http://127.0.0.1:{listener_port}/v1/chat/completions"
    api = httpx.Client(base_url=kvpilot.api_url, headers=ADMIN, timeout=10)

    # 1. The policy goes in through the REST API and comes back out of it.
    assert api.put("/v1/pools/sim", json=pool("sim", ports)).status_code in (200, 201)
    created = api.put("/v1/routingpolicies/web", json=policy("web", "sim", listener_port))
    assert created.status_code in (200, 201), created.text
    assert api.get("/v1/pools/sim").json()["spec"]["endpoints"][0]["port"] == ports[0]

    # 2. Envoy receives it and every replica serves traffic.
    wait_until(
        lambda: endpoint_weights(envoy, "web/all") == dict.fromkeys(ports, 100),
        30,
        message="Envoy to receive three endpoints of weight 100",
    )
    wait_until(
        lambda: set(served_by(url, 12)) == set(ids.values()),
        30,
        message="all three replicas to answer through Envoy",
    )

    # 3. A weight change through the API moves traffic.
    heavy = ports[0]
    response = api.put(f"/v1/pools/sim/endpoints/127.0.0.1:{heavy}/weight", json={"weight": 1000})
    assert response.status_code == 200, response.text
    wait_until(
        lambda: endpoint_weights(envoy, "web/all").get(heavy) == 1000,
        30,
        message="the new weight to reach Envoy",
    )
    counts = served_by(url, 60)
    assert counts[ids[heavy]] >= 45, counts  # expected 1000/1200 of 60 = 50

    # 4. Removing an endpoint through the API takes it out of rotation.
    removed = ports[2]
    body = api.get("/v1/pools/sim").json()
    body["spec"]["endpoints"] = [e for e in body["spec"]["endpoints"] if e["port"] != removed]
    assert api.put("/v1/pools/sim", json=body).status_code == 200
    wait_until(
        lambda: removed not in endpoint_weights(envoy, "web/all"),
        30,
        message="the removed endpoint to leave Envoy",
    )
    counts = served_by(url, 30)
    assert ids[removed] not in counts and sum(counts.values()) == 30, counts
