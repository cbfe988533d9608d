"""The hold of routes behind new clusters, on one stream with a clock the test moves: its
limit, and what ends it (test_ads_sotw and test_ads_delta show it over gRPC)."""

from __future__ import annotations

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from harness.xdsclient import make_snapshot
from prometheus_client import CollectorRegistry

from xdsserver.delta import DeltaStream
from xdsserver.resources import CLUSTER, LISTENER
from xdsserver.sotw import SotwStream
from xdsserver.status import ConnectionRegistry
from xdsserver.stream import WARMING_HOLD_SECONDS, Stream


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def joined(kind: type[SotwStream] | type[DeltaStream]) -> tuple[Stream, Clock, CollectorRegistry]:
    """A stream of `kind` subscribed to every cluster and listener."""
    metrics = CollectorRegistry()
    status = ConnectionRegistry(registry=metrics)
    conn = status.open(node_id="edge-1", fleet="default", peer="test", mode="sotw")
    clock = Clock()
    stream = kind(conn, status, clock=clock)
    for type_url in (CLUSTER, LISTENER):
        if kind is SotwStream:
            stream.handle(discovery_pb2.DiscoveryRequest(type_url=type_url))
        else:
            stream.handle(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url))
    return stream, clock, metrics


@pytest.mark.parametrize("kind", [SotwStream, DeltaStream], ids=["sotw", "delta"])
def test_a_hold_ends_at_its_limit_even_with_no_snapshot_left(
    kind: type[SotwStream] | type[DeltaStream],
) -> None:
    stream, clock, metrics = joined(kind)
    snapshot = make_snapshot({"a": [1]})
    assert [p.type_url for p in stream.plan(snapshot)] == [CLUSTER]  # the listener waits
    assert stream.wake_in() == WARMING_HOLD_SECONDS
    clock.now += WARMING_HOLD_SECONDS - 0.5
    assert stream.plan(snapshot) == []
    assert stream.wake_in() == 0.5
    # The fleet's snapshot is deleted meanwhile: the hold still ends at its limit (a writer
    # woken for it must not find it standing and spin).
    clock.now += 0.5
    assert stream.plan(None) == []
    assert stream.wake_in() is None
    assert metrics.get_sample_value("kvpilot_xds_warming_timeouts_total", {"fleet": "default"}) == 1
    assert [p.type_url for p in stream.plan(snapshot)] == [LISTENER]
