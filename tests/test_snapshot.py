"""Snapshot and SnapshotCache: content-hash versions, serialization once, per-fleet scoping."""

from __future__ import annotations

import asyncio

import pytest
from envoy.config.core.v3 import base_pb2
from harness.xdsclient import make_cluster, make_endpoints, make_messages

from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, Resource, resource_name
from xdsserver.snapshot import Snapshot, SnapshotCache


def test_versions_are_identical_for_equal_messages_built_separately() -> None:
    # Two replicas (or one after a restart) build from equal input: same versions everywhere.
    a = Snapshot.from_messages(make_messages({"a": [1, 2], "b": [3]}, route_to="a"))
    b = Snapshot.from_messages(make_messages({"b": [3], "a": [1, 2]}, route_to="a"))
    for type_url in (CLUSTER, ENDPOINT, LISTENER, ROUTE):
        assert a.version(type_url) == b.version(type_url) != ""
        assert {n: r.version for n, r in a.resources(type_url).items()} == {
            n: r.version for n, r in b.resources(type_url).items()
        }
    assert a == b


def test_version_changes_with_content_only_for_the_changed_type() -> None:
    a = Snapshot.from_messages(make_messages({"a": [1]}))
    b = Snapshot.from_messages(make_messages({"a": [2]}))
    assert a.version(ENDPOINT) != b.version(ENDPOINT)
    assert a.version(CLUSTER) == b.version(CLUSTER)


def test_absent_type_has_empty_version_and_present_empty_type_does_not() -> None:
    snap = Snapshot.from_messages({CLUSTER: []})
    assert snap.version(CLUSTER) != ""
    assert snap.version(LISTENER) == ""
    assert dict(snap.resources(LISTENER)) == {}


def test_duplicate_names_within_a_type_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Snapshot.from_messages({CLUSTER: [make_cluster("a"), make_cluster("a")]})


def test_message_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="listed under"):
        Snapshot.from_messages({ENDPOINT: [make_cluster("a")]})


def test_resource_names_follow_envoy() -> None:
    assert resource_name(make_endpoints("pool-a", [1])) == "pool-a"
    resource = Resource.from_message(make_cluster("pool-a"))
    assert resource.name == "pool-a"
    assert resource.type_url == CLUSTER
    assert resource.body.type_url == CLUSTER
    assert resource.body.value == make_cluster("pool-a").SerializeToString(deterministic=True)


def test_with_messages_reuses_unchanged_resources() -> None:
    base = Snapshot.from_messages(make_messages({"a": [1], "b": [2]}))
    updated = base.with_messages(ENDPOINT, [make_endpoints("b", [3])], replace_all=False)
    assert updated.resources(ENDPOINT)["a"] is base.resources(ENDPOINT)["a"]
    assert updated.resources(ENDPOINT)["b"].version != base.resources(ENDPOINT)["b"].version
    assert updated.resources(CLUSTER) is base.resources(CLUSTER)
    assert updated.version(CLUSTER) == base.version(CLUSTER)
    # Equal to a snapshot built from scratch with the same content.
    assert updated == Snapshot.from_messages(make_messages({"a": [1], "b": [3]}))

    removed = base.with_messages(ENDPOINT, [], replace_all=False, removed=["a"])
    assert list(removed.resources(ENDPOINT)) == ["b"]
    replaced = base.with_messages(ENDPOINT, [make_endpoints("c", [4])], replace_all=True)
    assert list(replaced.resources(ENDPOINT)) == ["c"]


def _node(node_id: str, cluster: str) -> base_pb2.Node:
    return base_pb2.Node(id=node_id, cluster=cluster)


def test_fleet_is_node_cluster_with_overrides_and_default() -> None:
    cache = SnapshotCache(node_overrides={"canary-1": "canary"})
    assert cache.fleet_for(_node("e1", "edge")) == "edge"
    assert cache.fleet_for(_node("e2", "")) == "default"
    assert cache.fleet_for(_node("canary-1", "edge")) == "canary"
    custom = SnapshotCache(fleet_of=lambda node: node.id.split("-")[0])
    assert custom.fleet_for(_node("gpu-7", "edge")) == "gpu"


def test_fleet_without_snapshot_gets_the_default_one() -> None:
    cache = SnapshotCache()
    default = Snapshot.from_messages(make_messages({"a": [1]}))
    edge = Snapshot.from_messages(make_messages({"b": [2]}))
    assert cache.snapshot_for("edge") is None
    cache.set_snapshot("default", default)
    assert cache.snapshot_for("edge") is default
    cache.set_snapshot("edge", edge)
    assert cache.snapshot_for("edge") is edge
    assert cache.fleets() == ["default", "edge"]
    cache.delete_snapshot("edge")
    assert cache.snapshot_for("edge") is default


async def test_set_snapshot_wakes_only_the_streams_it_concerns() -> None:
    cache = SnapshotCache()
    cache.set_snapshot("edge", Snapshot.from_messages(make_messages({"b": [2]})))
    on_default = cache.watch("default")
    on_edge = cache.watch("edge")
    on_other = cache.watch("other")  # no snapshot of its own: follows the default fleet

    cache.set_snapshot("default", Snapshot.from_messages(make_messages({"a": [1]})))
    assert on_default.event.is_set() and on_other.event.is_set()
    assert not on_edge.event.is_set()
    assert on_default.consume() is not None
    on_other.consume()

    cache.set_snapshot("edge", Snapshot.from_messages(make_messages({"b": [3]})))
    assert on_edge.event.is_set()
    assert not on_default.event.is_set() and not on_other.event.is_set()
    on_edge.consume()

    # Same content again: nobody wakes.
    cache.set_snapshot("edge", Snapshot.from_messages(make_messages({"b": [3]})))
    assert not on_edge.event.is_set()

    # Many changes while a stream is busy: one wakeup, the time of the first change kept.
    first_change = None
    for port in range(10):
        cache.set_snapshot("edge", Snapshot.from_messages(make_messages({"b": [port + 100]})))
        first_change = first_change or on_edge.changed_at
    assert on_edge.consume() == first_change
    cache.unwatch(on_edge)
    assert on_edge not in cache.watches()
    await asyncio.sleep(0)
