"""What reaches Envoy from etcd outside the happy path, end to end: leases and garbage.

A backend that registers itself with a TTL leaves Envoy when its lease runs out; a value
written straight into etcd that kvpilot cannot use is reported in `/v1/status` and ignored,
and a valid object overwritten with garbage keeps serving its last valid version.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from harness.builders import policy, pool, route
from harness.envoy import endpoint_weights
from harness.rig import api_client, apply
from harness.status import acked_everything, envoy_types
from harness.traffic import replicas_behind
from harness.wait import wait_until

from controlplane.etcd import EtcdClient
from controlplane.local import EmbeddedEtcd, free_port

pytestmark = pytest.mark.e2e

CLUSTER = "web/all"


def keepalive(etcd: EmbeddedEtcd, lease: int) -> None:
    """Refresh a lease once, as a self-registering backend would."""

    async def once() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            await client.keepalive_once(lease)

    asyncio.run(once())


def etcd_put(etcd: EmbeddedEtcd, values: dict[str, bytes]) -> None:
    """Write raw values straight into etcd, the way etcdctl (or an old kvpilot) would."""

    async def write() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            for key, value in values.items():
                await client.put(key.encode(), value)

    asyncio.run(write())


def invalid_objects(api: httpx.Client) -> dict[str, dict[str, Any]]:
    response = api.get("/v1/status")
    response.raise_for_status()
    return {error["key"]: error for error in response.json()["invalidObjects"]}


def test_an_endpoint_registered_with_a_ttl_leaves_envoy_when_its_lease_expires(
    etcd: EmbeddedEtcd, etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    static, leased = backends(1, id_prefix="static"), backends(1, id_prefix="leased")
    [static_replica], [leased_replica] = static.replicas, leased.replicas
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port)
    port = free_port()
    api = api_client(kvpilot)
    apply(api, pool("sim", [static_replica.port], models=["sim-model"]))
    apply(api, policy("web", port, [route("sim", balancing="round_robin")], fleets=["default"]))

    response = api.put(
        "/v1/pools/sim/endpoints/leased-0?ttl=3",
        json={"address": "127.0.0.1", "port": leased_replica.port},
    )
    assert response.status_code == 200, response.text
    lease = response.json()["lease"]
    assert lease

    def registered_and_serving() -> bool:
        # Kept alive until Envoy has it, so a slow machine cannot let it expire first.
        keepalive(etcd, lease)
        return replicas_behind(port) == {static_replica.id, leased_replica.id}

    wait_until(registered_and_serving, 30, message="the registered endpoint to take traffic")
    assert leased_replica.port in endpoint_weights(envoy, CLUSTER)

    # No more keepalives: the lease expires, etcd deletes the key, Envoy drops the endpoint.
    wait_until(
        lambda: endpoint_weights(envoy, CLUSTER) == {static_replica.port: 100},
        30,
        message="the endpoint to leave Envoy's /clusters after its lease expired",
    )
    assert replicas_behind(port) == {static_replica.id}
    assert api.get("/v1/pools/sim/endpoints").json()["items"] == []


def test_garbage_in_etcd_is_reported_and_ignored_and_the_last_valid_pool_keeps_serving(
    etcd: EmbeddedEtcd, etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    replicas = backends(2, id_prefix="be")
    ports = [r.port for r in replicas.replicas]
    ids = [r.id for r in replicas.replicas]
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port)
    port = free_port()
    api = api_client(kvpilot)
    apply(api, pool("sim", ports, models=["sim-model"]))
    apply(api, policy("web", port, [route("sim", balancing="round_robin")], fleets=["default"]))
    wait_until(lambda: replicas_behind(port) == set(ids), 30, message="both replicas to answer")
    good = wait_until(lambda: acked_everything(api, envoy), 30, message="the Envoy to ACK")

    invalid_pool = pool("y", [ports[0]], models=["sim-model"])
    invalid_pool["spec"]["endpoints"][0]["port"] = 70000
    # Were it valid, this would take replica 1 out of rotation.
    overwritten = pool("sim", [ports[0]], models=["sim-model"])
    overwritten["spec"]["endpoints"][0]["weight"] = "heavy"
    etcd_put(
        etcd,
        {
            f"{etcd_prefix}/objects/pools/x": b"not json",
            f"{etcd_prefix}/objects/pools/y": json.dumps(invalid_pool).encode(),
            f"{etcd_prefix}/objects/pools/sim": json.dumps(overwritten).encode(),
        },
    )
    keys = {"objects/pools/x", "objects/pools/y", "objects/pools/sim"}
    errors = wait_until(
        lambda: (found := invalid_objects(api)).keys() == keys and found,
        30,
        message="the three bad values to show in /v1/status",
    )
    assert errors["objects/pools/sim"]["serving_previous"] is True
    assert errors["objects/pools/x"]["serving_previous"] is False
    assert "port" in errors["objects/pools/y"]["message"], errors
    assert "weight" in errors["objects/pools/sim"]["message"], errors

    # Nothing changed for the Envoy: same versions, no NACK, both replicas still answer.
    assert acked_everything(api, envoy) == good
    assert all(t["last_nack"] is None for t in envoy_types(api, envoy.node_id).values())
    assert replicas_behind(port) == set(ids)

    # A valid write through the API replaces the garbage and flows; the other garbage stays
    # reported until it is deleted.
    apply(api, pool("sim", [ports[0]], models=["sim-model"]))
    wait_until(lambda: replicas_behind(port) == {ids[0]}, 30, message="the valid pool to flow")
    assert invalid_objects(api).keys() == keys - {"objects/pools/sim"}
    for name in ("x", "y"):
        assert api.delete(f"/v1/pools/{name}").status_code == 204
    wait_until(lambda: not invalid_objects(api), 30, message="deleted garbage to leave status")
    assert replicas_behind(port) == {ids[0]}
