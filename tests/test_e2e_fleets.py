"""Fleets: an Envoy gets its node.cluster's config, the default fleet's when its fleet has none
of its own, and the config of the fleet its node id is pinned to with --node-fleet."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import ADMIN_TOKEN
from util import wait_until

from controlplane.launchers import EmbeddedEnvoy, free_port

pytestmark = pytest.mark.e2e


def listeners(envoy: EmbeddedEnvoy) -> set[str]:
    dump = envoy.config_dump()["configs"]
    return {
        listener["name"]
        for config in dump
        for listener in config.get("dynamic_listeners", [])
        if "active_state" in listener
    }


def test_envoys_get_their_fleets_config(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any
) -> None:
    kvpilot = kvpilot_factory(etcd_prefix, extra_args=["--node-fleet", "pinned-envoy=edge"])
    api = httpx.Client(
        base_url=kvpilot.api_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    )
    pool = {"kind": "Pool", "metadata": {"name": "p"}, "spec": {}}
    assert api.put("/v1/pools/p", json=pool).is_success
    ports = {"default": free_port(), "edge": free_port()}
    for fleet, port in ports.items():
        policy = {
            "kind": "RoutingPolicy",
            "metadata": {"name": fleet},
            "spec": {
                "fleets": [fleet],
                "listener": {"address": "127.0.0.1", "port": port},
                "routes": [{"name": "r", "tiers": [["p"]]}],
            },
        }
        assert api.put(f"/v1/routingpolicies/{fleet}", json=policy).is_success

    default = envoy_factory(xds_port=kvpilot.xds_port, fleet="default")
    edge = envoy_factory(xds_port=kvpilot.xds_port, fleet="edge")
    unknown = envoy_factory(xds_port=kvpilot.xds_port, fleet="no-such-fleet")
    pinned = envoy_factory(xds_port=kvpilot.xds_port, fleet="default", node_id="pinned-envoy")
    expected = {
        "default": {f"listener-{ports['default']}"},
        "edge": {f"listener-{ports['edge']}"},
    }
    for envoy, fleet in (
        (default, "default"),
        (edge, "edge"),
        (unknown, "default"),
        (pinned, "edge"),
    ):
        wait_until(
            lambda envoy=envoy, fleet=fleet: listeners(envoy) == expected[fleet],
            30,
            message=f"{envoy.node_id} to serve the {fleet} fleet's listener",
        )
    status = api.get("/v1/status").json()
    fleets = {envoy["node_id"]: envoy["fleet"] for envoy in status["envoys"]}
    assert fleets["pinned-envoy"] == "edge"
    assert fleets[unknown.node_id] == "no-such-fleet"
