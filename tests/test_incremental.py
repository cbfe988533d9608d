"""The EDS fast path re-serializes exactly the ClusterLoadAssignments whose endpoints changed.

What it reuses is the very Resource the Envoys were sent, so a SotW push (which leaves out a
named resource whose version the Envoy already runs) carries exactly the changed assignments:
a cluster compiled again into an equal object must not count as changed (more), and a changed
one must never be taken for the old one (less).
"""

from __future__ import annotations

from dataclasses import replace

from compiler import FleetPlan
from compiler.plan import PlanCluster, PlanEndpoint
from policies.models import CircuitBreakers, HealthCheck, OutlierDetection
from xdsserver import resources
from xdsserver.incremental import build_snapshot


def cluster(name: str, *weights: int) -> PlanCluster:
    return PlanCluster(
        name=name,
        protocol="http1",
        balancing="round_robin",
        affinity=None,
        connect_timeout=5.0,
        health_check=HealthCheck(),
        outlier_detection=OutlierDetection(),
        circuit_breakers=CircuitBreakers(),
        tls=None,
        auth=None,
        endpoints=tuple(
            PlanEndpoint(name, f"10.0.0.{i + 1}", 8000, weight, 0)
            for i, weight in enumerate(weights)
        ),
    )


def test_an_endpoint_change_reserializes_only_its_assignment() -> None:
    old = FleetPlan(
        fleet="default",
        listeners=(),
        clusters=(cluster("a", 1, 2), cluster("b", 3), cluster("c", 4)),
    )
    before, path = build_snapshot(old, None, None)
    assert path == "full"
    # "a" changed; "b" compiled again into an equal, new object; "c" is the very same object.
    new = replace(old, clusters=(cluster("a", 1, 9), cluster("b", 3), old.clusters[2]))
    after, path = build_snapshot(new, old, before)
    assert path == "fast"
    old_eds, new_eds = before.resources(resources.ENDPOINT), after.resources(resources.ENDPOINT)
    assert new_eds["a"].version != old_eds["a"].version
    assert new_eds["b"] is old_eds["b"] and new_eds["c"] is old_eds["c"]
    # Every other type is shared as it was.
    for type_url in (resources.CLUSTER, resources.LISTENER, resources.ROUTE):
        assert after.resources(type_url) == before.resources(type_url)
    assert after.version(resources.CLUSTER) == before.version(resources.CLUSTER)


def test_a_plan_equal_to_the_last_reuses_the_snapshot() -> None:
    old = FleetPlan(fleet="default", listeners=(), clusters=(cluster("a", 1), cluster("b", 2)))
    before, _ = build_snapshot(old, None, None)
    again = replace(old, clusters=(cluster("a", 1), cluster("b", 2)))
    after, path = build_snapshot(again, old, before)
    assert path == "fast" and after is before


def test_a_gate_beside_its_replicas_keeps_the_fast_path() -> None:
    """A route's gate (``overflow.maxInFlight``) carries its replicas' endpoints and reads
    their assignment: an endpoint change changes both clusters and re-serializes the
    replicas' assignment alone."""
    gate = replace(cluster("a/gate", 1, 2), kind="gate", eds_service="a")
    old = FleetPlan(fleet="default", listeners=(), clusters=(cluster("a", 1, 2), gate))
    before, _ = build_snapshot(old, None, None)
    assert "a/gate" not in before.resources(resources.ENDPOINT)
    moved = replace(gate, endpoints=cluster("a/gate", 1, 9).endpoints)
    new = replace(old, clusters=(cluster("a", 1, 9), moved))
    after, path = build_snapshot(new, old, before)
    assert path == "fast"
    assert set(after.resources(resources.ENDPOINT)) == {"a"}
    assert (
        after.resources(resources.ENDPOINT)["a"].version
        != before.resources(resources.ENDPOINT)["a"].version
    )
    assert after.version(resources.CLUSTER) == before.version(resources.CLUSTER)
