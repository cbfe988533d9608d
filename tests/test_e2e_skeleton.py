"""The walking skeleton, end to end: REST API -> etcd -> kvpilot -> ADS -> Envoy -> replicas.

Real etcd, a real `kvpilot serve` process, a real Envoy and simulated replicas; the
assertions are on which replica answered requests sent through Envoy, before and after
changes made through the REST API.
"""

from __future__ import annotations

import pytest
from harness.builders import policy, pool, route
from harness.envoy import endpoint_weights
from harness.rig import BackendFactory, Rig, ports_of
from harness.traffic import served_by
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


def test_traffic_through_envoy_follows_changes_made_through_the_api(
    rig: Rig, backends: BackendFactory
) -> None:
    replicas = backends(3, id_prefix="be")
    ports = ports_of(replicas)
    ids = {replica.port: replica.id for replica in replicas.replicas}
    envoy, api, url = rig.envoy, rig.api, rig.url()

    # 1. The policy goes in through the REST API and comes back out of it.
    sim = pool("sim", ports, models=["sim-model"], weights={})
    assert api.put("/v1/pools/sim", json=sim).status_code in (200, 201)
    web = policy("web", rig.listener_port, [route("sim", balancing="round_robin")])
    created = api.put("/v1/routingpolicies/web", json=web)
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
