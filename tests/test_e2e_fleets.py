"""Fleets: an Envoy gets its node.cluster's config, the default fleet's when its fleet has none
of its own, and the config of the fleet its node id is pinned to with --node-fleet."""

from __future__ import annotations

from typing import Any

import pytest
from harness.builders import fleet_policies
from harness.envoy import active_listeners
from harness.rig import api_client, apply
from harness.wait import wait_until

from controlplane.local import free_port

pytestmark = pytest.mark.e2e


def test_envoys_get_their_fleets_config(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any
) -> None:
    kvpilot = kvpilot_factory(etcd_prefix, extra_args=["--node-fleet", "pinned-envoy=edge"])
    api = api_client(kvpilot)
    ports = {"default": free_port(), "edge": free_port()}
    apply(api, *fleet_policies(ports))

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
            lambda envoy=envoy, fleet=fleet: active_listeners(envoy) == expected[fleet],
            30,
            message=f"{envoy.node_id} to serve the {fleet} fleet's listener",
        )
    status = api.get("/v1/status").json()
    fleets = {envoy["node_id"]: envoy["fleet"] for envoy in status["envoys"]}
    assert fleets["pinned-envoy"] == "edge"
    assert fleets[unknown.node_id] == "no-such-fleet"
