"""ADS incremental (DeltaAggregatedResources) against a real grpc.aio server."""

from __future__ import annotations

from typing import Any

from harness.wait import poll
from harness.xdsclient import (
    DeltaStream,
    RunningServer,
    assert_well_formed,
    make_cluster,
    make_listener,
    make_messages,
    make_snapshot,
    names_of,
    unpack,
)

from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from xdsserver.snapshot import Snapshot


async def recv(s: DeltaStream, type_url: str | None = None) -> Any:
    response = assert_well_formed(await (s.recv_type(type_url) if type_url else s.recv()))
    assert response.system_version_info
    assert all(r.version for r in response.resources)
    return response


def versions(response: Any) -> dict[str, str]:
    return {r.name: r.version for r in response.resources}


async def test_legacy_wildcard_gets_everything_with_versions_and_ack(ads: RunningServer) -> None:
    snapshot = make_snapshot({"a": [1], "b": [2]})
    ads.cache.set_snapshot("default", snapshot)
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        response = await recv(s)
        assert response.system_version_info == snapshot.version(CLUSTER)
        assert versions(response) == {n: r.version for n, r in snapshot.resources(CLUSTER).items()}
        assert list(response.removed_resources) == []
        await s.ack(response)
        await s.expect_silence()
        [conn] = ads.status.connections()
        assert conn.mode == "delta"
        assert conn.types[CLUSTER].version_acked == snapshot.version(CLUSTER)
        assert conn.types[CLUSTER].wildcard
        assert ads.metric("kvpilot_xds_streams", mode="delta") == 1


async def test_only_changed_resources_are_sent(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.delta("envoy-1") as s:
        await s.send(ENDPOINT, ["a", "b", "a"])
        first = await recv(s)
        assert sorted(names_of(first)) == ["a", "b"]
        await s.ack(first)
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [7]}))
        update = await recv(s)
        assert names_of(update) == ["b"]
        assert (
            unpack(update.resources[0].resource)
            .endpoints[0]
            .lb_endpoints[0]
            .endpoint.address.socket_address.port_value
            == 7
        )


async def test_nack_is_recorded_and_not_answered(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.delta("envoy-1") as s, ads.delta("envoy-2") as other:
        for stream in (s, other):
            await stream.send(CLUSTER)
            await stream.ack(await recv(stream))
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
        rejected = await recv(s)
        await other.ack(await recv(other))
        await s.nack(rejected, "cluster b: bad config")
        await s.expect_silence()
        [conn] = ads.status.find("envoy-1")
        nack = conn.types[CLUSTER].last_nack
        assert nack is not None and nack.message == "cluster b: bad config"
        assert nack.version == rejected.system_version_info
        assert ads.status.find("envoy-2")[0].types[CLUSTER].last_nack is None
        assert ads.metric("kvpilot_xds_nacks_total", type="CDS", fleet="default") == 1
        # The next different snapshot flows, with what changed since the version the Envoy
        # runs: b again (the Envoy kept what it had), and c.
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2], "c": [3]}))
        assert sorted(names_of(await recv(s))) == ["b", "c"]


async def test_subscription_on_a_stale_nonce_is_applied(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.delta("envoy-1") as s:
        await s.send(ENDPOINT, ["a"])
        old = await recv(s)
        ads.cache.set_snapshot("default", make_snapshot({"a": [5], "b": [2]}))
        new = await recv(s)
        assert names_of(new) == ["a"]
        await s.send(ENDPOINT, ["b"], nonce=old.nonce)  # stale, but the subscription counts
        assert names_of(await recv(s)) == ["b"]
        [conn] = ads.status.connections()
        assert conn.types[ENDPOINT].resource_names == ["a", "b"]
        # Envoys answer in order: the older nonce accepts the older response, not the newer.
        assert conn.types[ENDPOINT].version_acked == old.system_version_info


async def test_deleted_resources_go_in_removed_resources(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
        response = await recv(s)
        assert list(response.removed_resources) == ["b"]
        assert names_of(response) == []


async def test_unsubscribed_names_are_dropped_silently(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.delta("envoy-1") as s:
        await s.send(ENDPOINT, ["a", "b"])
        response = await recv(s)
        await s.ack(response)
        await s.send(ENDPOINT, unsubscribe=["b"], nonce=response.nonce)
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [9]}))
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [3]}))
        update = await recv(s)
        assert names_of(update) == ["a"] and list(update.removed_resources) == []


async def test_requested_name_is_pushed_when_it_appears(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.delta("envoy-1") as s:
        await s.send(ENDPOINT, ["later"])
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "later": [4]}))
        assert names_of(await recv(s)) == ["later"]


async def test_explicit_wildcard_and_its_removal(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.delta("envoy-1") as s:
        await s.send(ENDPOINT, ["*"])
        response = await recv(s)
        assert sorted(names_of(response)) == ["a", "b"]
        await s.ack(response)
        # Keep a by name, drop the wildcard: b leaves without a removal (the Envoy drops it).
        await s.send(ENDPOINT, ["a"], ["*"], nonce=response.nonce)
        resubscribed = await recv(s)  # a (re)subscription is always answered
        assert names_of(resubscribed) == ["a"] and list(resubscribed.removed_resources) == []
        await s.ack(resubscribed)
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [3], "c": [4]}))
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [2], "b": [3], "c": [4]}))
        assert names_of(await recv(s)) == ["a"]


async def test_reconnect_with_initial_versions_gets_exactly_the_differences(
    ads: RunningServer,
) -> None:
    before = make_snapshot({"a": [1], "b": [2], "gone": [3]})
    ads.cache.set_snapshot("default", before)
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        first = await recv(s)
        await s.ack(first)
        await s.send(ENDPOINT, ["a", "b", "gone"])
        endpoints = await recv(s)
        await s.ack(endpoints)
    had_clusters, had_endpoints = versions(first), versions(endpoints)

    # While the Envoy is away: b's endpoints change, "gone" is deleted, "new" appears.
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [8], "new": [5]}))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER, initial_versions=had_clusters)
        clusters = await recv(s)
        assert names_of(clusters) == ["new"]
        # The routes the Envoy holds may still use "gone": it goes once "new" warmed.
        assert list(clusters.removed_resources) == []
        await s.ack(clusters)
        removal = await recv(s)
        assert names_of(removal) == [] and list(removal.removed_resources) == ["gone"]
        await s.ack(removal)
        # Envoy re-subscribes to what it had before it processes the CDS update.
        await s.send(ENDPOINT, ["a", "b", "gone"], initial_versions=had_endpoints)
        update = await recv(s)
        assert names_of(update) == ["b"]
        assert list(update.removed_resources) == ["gone"]


async def test_make_before_break_order_adds_then_removals(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"old": [1]}, listener_port=10000))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        await s.send(ENDPOINT, ["old", "new"])  # "new" is remembered until it exists
        await s.ack(await recv(s))
        await s.send(LISTENER)
        await s.ack(await recv(s))
        await s.send(ROUTE, ["ingress-routes"])
        await s.ack(await recv(s))

        # Everything moves from cluster "old" to "new".
        ads.cache.set_snapshot("default", make_snapshot({"new": [2]}, listener_port=10001))
        pushes = [await recv(s) for _ in range(2)]
        # The new cluster warms before anything routes to it (Envoy answers the CDS response
        # once it did); what still routes to the old one keeps it until then.
        await s.expect_silence()
        [conn] = ads.status.connections()
        assert conn.as_dict()["warming"]["clusters"] == ["new"]
        await s.ack(pushes[0])
        pushes += [await recv(s) for _ in range(4)]
        kinds = [(p.type_url, "add" if p.resources else "remove") for p in pushes]
        assert kinds == [
            (CLUSTER, "add"),
            (ENDPOINT, "add"),
            (LISTENER, "add"),
            (ROUTE, "add"),
            (CLUSTER, "remove"),
            (ENDPOINT, "remove"),
        ]
        assert pushes[4].system_version_info == ads.cache.snapshot_for("default").version(CLUSTER)  # type: ignore[union-attr]
        assert pushes[0].system_version_info != pushes[4].system_version_info


async def test_fleets_are_scoped_in_delta_too(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"shared": [1]}))
    ads.cache.set_snapshot("gpu", make_snapshot({"gpu-pool": [2]}))
    async with ads.delta("e1", "gpu") as gpu, ads.delta("e2", "unknown") as other:
        await gpu.send(CLUSTER)
        await other.send(CLUSTER)
        assert names_of(await recv(gpu)) == ["gpu-pool"]
        assert names_of(await recv(other)) == ["shared"]


async def test_rebuilt_cluster_gets_its_endpoints_resent(ads: RunningServer) -> None:
    # Seen with Envoy 1.40: a cluster rebuilt under the same name stays warming until its
    # ClusterLoadAssignment arrives again, and Delta Envoy does not re-subscribe to it.
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        await s.send(ENDPOINT, ["a"])
        endpoints = await recv(s)
        await s.ack(endpoints)
        messages = make_messages({"a": [1]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900)]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        clusters = await recv(s)
        assert clusters.type_url == CLUSTER and names_of(clusters) == ["a"]
        resent = await recv(s)
        assert resent.type_url == ENDPOINT
        assert versions(resent) == versions(endpoints)


async def test_a_wildcard_subscription_to_an_empty_set_is_answered(ads: RunningServer) -> None:
    """An Envoy of a fleet with no listeners yet must still finish initializing at once."""
    ads.cache.set_snapshot("default", Snapshot.from_messages({CLUSTER: [], LISTENER: []}))
    async with ads.delta("envoy-1") as s:
        await s.send(LISTENER)
        response = await recv(s)
        assert names_of(response) == [] and list(response.removed_resources) == []
        await s.ack(response)
        await s.expect_silence()


async def test_a_rebuilt_affinity_twin_gets_the_shared_endpoints_resent(
    ads: RunningServer,
) -> None:
    """kvpilot's affinity twin reads its route cluster's assignment (eds service name)."""

    def twin(timeout_ms: int) -> Snapshot:
        messages = make_messages({"a": [1]})
        messages[CLUSTER] = [
            make_cluster("a"),
            make_cluster("a/affinity", timeout_ms=timeout_ms, service_name="a"),
        ]
        return Snapshot.from_messages(messages)

    ads.cache.set_snapshot("default", twin(250))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        await s.send(ENDPOINT, ["a"])
        endpoints = await recv(s)
        await s.ack(endpoints)
        ads.cache.set_snapshot("default", twin(900))
        clusters = await recv(s)
        assert clusters.type_url == CLUSTER and names_of(clusters) == ["a/affinity"]
        resent = await recv(s)
        assert resent.type_url == ENDPOINT and versions(resent) == versions(endpoints)


async def test_an_empty_wildcard_answer_is_sent_alongside_other_changes(
    ads: RunningServer,
) -> None:
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.send(LISTENER)
        await s.expect_silence()  # no snapshot yet: the Envoy waits
        ads.cache.set_snapshot(
            "default",
            Snapshot.from_messages({CLUSTER: [], LISTENER: [make_listener("ingress", "r")]}),
        )
        got = {response.type_url: response for response in [await recv(s), await recv(s)]}
        assert names_of(got[CLUSTER]) == [] and names_of(got[LISTENER]) == ["ingress"]


def rebuilt_a(clusters: dict[str, list[int]]) -> Snapshot:
    """`clusters` routed to a, with cluster a rebuilt (another connect timeout)."""
    messages = make_messages(clusters, route_to="a")
    messages[CLUSTER] = [make_cluster("a", timeout_ms=900), *messages[CLUSTER][1:]]
    return Snapshot.from_messages(messages)


async def test_a_nack_of_the_earlier_response_of_a_round_is_counted(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "x": [2]}, route_to="x"))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        await s.send(ROUTE, ["ingress-routes"])
        await s.ack(await recv(s))
        # Cluster a is rebuilt and x goes, the route moving to a: updates first (CDS, RDS),
        # the removal of x after.
        ads.cache.set_snapshot("default", rebuilt_a({"a": [1]}))
        updated, routes, removed = [await recv(s) for _ in range(3)]
        assert names_of(updated) == ["a"] and list(removed.removed_resources) == ["x"]
        # Envoy answers in order; the NACK of the first carries a nonce that is not the latest.
        await s.nack(updated, "cluster a: bad")
        await s.ack(routes)
        await s.ack(removed)
        await poll(lambda: ads.metric("kvpilot_xds_nacks_total", type="CDS", fleet="default") == 1)
        [conn] = ads.status.find("envoy-1")
        nack = conn.types[CLUSTER].last_nack
        assert nack is not None and nack.version == updated.system_version_info
        # What the Envoy runs lacks the new a: the next version carries it again.
        ads.cache.set_snapshot("default", rebuilt_a({"a": [1], "c": [3]}))
        assert sorted(names_of(await recv(s, CLUSTER))) == ["a", "c"]


async def test_after_a_nack_of_the_kept_set_the_assignment_follows_its_cluster(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"x": [1]}))
    async with ads.delta("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        await s.send(ENDPOINT, ["x", "a"])
        await s.ack(await recv(s))
        await s.send(ROUTE, ["ingress-routes"])
        await s.ack(await recv(s))
        # Everything moves from x to a new cluster a: a goes first, x waits for the routes.
        ads.cache.set_snapshot("default", make_snapshot({"a": [2]}))
        kept = await recv(s, CLUSTER)
        assert names_of(kept) == ["a"] and list(kept.removed_resources) == []
        await s.ack(await recv(s, ENDPOINT))
        await s.expect_silence()
        await s.nack(kept, "cluster a: bad")
        # Holding the routes for a cluster the Envoy turned down would not help: the routes
        # go, then a again with x's removal, and a's assignment after its cluster (in Delta,
        # Envoy warms a cluster with the assignment it reads after the cluster arrived).
        pushes = [await recv(s) for _ in range(3)]
        assert [p.type_url for p in pushes] == [ROUTE, CLUSTER, ENDPOINT]
        assert names_of(pushes[1]) == ["a"] and list(pushes[1].removed_resources) == ["x"]
        assert names_of(pushes[2]) == ["a"] and list(pushes[2].removed_resources) == ["x"]
