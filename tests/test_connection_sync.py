"""Per-Envoy sync state: when each Envoy last ACKed, and how long a fleet has waited for one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from xdsserver import resources
from xdsserver.status import ConnectionRegistry


def test_unacked_time_grows_until_the_envoy_acks_what_it_was_sent() -> None:
    now = [100.0]
    registry = CollectorRegistry()
    connections = ConnectionRegistry(registry=registry, clock=lambda: now[0])
    edge = connections.open(node_id="e1", fleet="edge", peer="p", mode="sotw")
    calm = connections.open(node_id="d1", fleet="default", peer="p", mode="sotw")
    connections.sent(calm, resources.CLUSTER, version="v1", nonce="1")
    connections.acked(calm, resources.CLUSTER, version="v1")

    connections.sent(edge, resources.CLUSTER, version="v1", nonce="1")
    now[0] = 130.0
    connections.nacked(edge, resources.CLUSTER, version="v1", nonce="1", message="bad")
    now[0] = 190.0
    assert connections.unacked_seconds() == {"edge": 90.0, "default": 0.0}
    sample = registry.get_sample_value("kvpilot_xds_unacked_seconds", {"fleet": "edge"})
    assert sample == 90.0
    state = connections.as_dict()["connections"][0]["types"][resources.CLUSTER]
    assert state["unacked_since"] == 100.0 and state["acked_at"] is None

    # A newer version sent keeps the wait going from the first unACKed send; an ACK ends it.
    connections.sent(edge, resources.CLUSTER, version="v2", nonce="2")
    assert connections.unacked_seconds()["edge"] == 90.0
    connections.acked(edge, resources.CLUSTER, version="v2")
    assert connections.unacked_seconds()["edge"] == 0.0
    state = connections.as_dict()["connections"][0]["types"][resources.CLUSTER]
    assert state["acked_at"] == 190.0 and state["unacked_since"] is None
