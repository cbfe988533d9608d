"""ADS state-of-the-world (StreamAggregatedResources) against a real grpc.aio server."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from harness.wait import poll
from harness.xdsclient import (
    RunningServer,
    SotwStream,
    assert_well_formed,
    make_cluster,
    make_endpoints,
    make_listener,
    make_messages,
    make_route,
    make_snapshot,
    names_of,
    unpack,
)

from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from xdsserver.snapshot import Snapshot


def metric(ads: RunningServer, name: str, **labels: str) -> float:
    return ads.metric(name, **labels)


async def recv(s: SotwStream, type_url: str | None = None, *, within: float = 5.0) -> Any:
    return assert_well_formed(await (s.recv_type(type_url, within) if type_url else s.recv(within)))


async def join(s: SotwStream, eds: list[str], rds: list[str]) -> dict[str, Any]:
    """Subscribe like Envoy does at start: CDS, then EDS for its clusters, LDS, RDS; ACK each."""
    got = {}
    for type_url, names in ((CLUSTER, []), (ENDPOINT, eds), (LISTENER, []), (ROUTE, rds)):
        await s.send(type_url, names)
        got[type_url] = response = await recv(s)
        assert response.type_url == type_url
        await s.ack(response, names)
    return got


async def test_ack_records_the_version_and_triggers_no_resend(ads: RunningServer) -> None:
    snapshot = make_snapshot({"a": [1], "b": [2]})
    ads.cache.set_snapshot("default", snapshot)
    async with ads.sotw("envoy-1") as s:
        got = await join(s, ["a", "b"], ["ingress-routes"])
        for type_url, response in got.items():
            # version_info is the snapshot's content hash for the type (rule 2).
            assert response.version_info == snapshot.version(type_url)
        assert len({r.nonce for r in got.values()}) == 4
        await s.expect_silence()
        [conn] = ads.status.connections()
        assert conn.node_id == "envoy-1" and conn.fleet == "default" and conn.mode == "sotw"
        assert conn.types[CLUSTER].version_acked == snapshot.version(CLUSTER)
        assert conn.types[ENDPOINT].resource_names == ["a", "b"]
        assert metric(ads, "kvpilot_xds_acks_total", type="CDS") == 1
        assert metric(ads, "kvpilot_xds_pushes_total", type="EDS") == 1


async def test_wildcard_cds_gets_all_and_named_eds_only_what_it_asks(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2], "c": [3]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER, [])
        assert sorted(names_of(await recv(s))) == ["a", "b", "c"]
    async with ads.sotw("envoy-2") as s:
        await s.send(CLUSTER, ["*"])
        assert sorted(names_of(await recv(s))) == ["a", "b", "c"]
        await s.send(ENDPOINT, ["b", "b"])
        response = await recv(s)
        assert names_of(response) == ["b"]
        assert unpack(response.resources[0]) == make_endpoints("b", [2])


async def test_nack_is_recorded_and_never_answered_with_the_same_config(
    ads: RunningServer,
) -> None:
    bad = make_snapshot({"a": [1]})
    ads.cache.set_snapshot("default", bad)
    async with ads.sotw("envoy-1") as s, ads.sotw("envoy-2") as other:
        first = (await join(s, ["a"], ["ingress-routes"]))[ENDPOINT]
        await join(other, ["a"], ["ingress-routes"])

        ads.cache.set_snapshot("default", make_snapshot({"a": [2]}))
        rejected = await recv(s, ENDPOINT)
        await other.ack(await recv(other, ENDPOINT), ["a"])
        await s.nack(rejected, "bad endpoint", good_version=first.version_info, names=["a"])
        await s.expect_silence()  # no resend of the rejected config

        [conn] = ads.status.find("envoy-1")
        nack = conn.types[ENDPOINT].last_nack
        assert nack is not None
        assert nack.message == "bad endpoint" and nack.version == rejected.version_info
        assert conn.types[ENDPOINT].version_acked == first.version_info
        [peer] = ads.status.find("envoy-2")
        assert peer.types[ENDPOINT].last_nack is None
        assert metric(ads, "kvpilot_xds_nacks_total", type="EDS", fleet="default") == 1
        json_view = ads.status.as_dict()["connections"]
        assert any(c["types"][ENDPOINT]["last_nack"] for c in json_view)

        # The next different version flows normally, to both.
        fixed = make_snapshot({"a": [3]})
        ads.cache.set_snapshot("default", fixed)
        assert (await recv(s, ENDPOINT)).version_info == fixed.version(ENDPOINT)
        assert (await recv(other, ENDPOINT)).version_info == fixed.version(ENDPOINT)


async def test_stale_nonce_is_ignored(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["a"])
        old = await recv(s)
        ads.cache.set_snapshot("default", make_snapshot({"a": [5], "b": [2]}))
        new = await recv(s)
        assert new.nonce != old.nonce
        # A request carrying the older nonce (sent before it saw `new`) is ignored entirely.
        await s.send(ENDPOINT, ["a", "b"], version=old.version_info, nonce=old.nonce)
        await s.expect_silence()
        # The same request with the latest nonce is acted upon.
        await s.send(ENDPOINT, ["a", "b"], version=new.version_info, nonce=new.nonce)
        assert sorted(names_of(await recv(s))) == ["a", "b"]


async def test_requested_name_is_pushed_when_it_appears(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["a", "later"])
        response = await recv(s)
        assert names_of(response) == ["a"]
        await s.ack(response, ["a", "later"])
        await ads.settled("envoy-1", response)
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "later": [9]}))
        # A push of a named type carries only what changed; Envoy keeps "a".
        assert names_of(await recv(s)) == ["later"]


async def test_eds_push_carries_only_the_changed_assignments(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2], "c": [3]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["a", "b", "c"])
        response = await recv(s)
        assert names_of(response) == ["a", "b", "c"]
        await s.ack(response, ["a", "b", "c"])
        await ads.settled("envoy-1", response)
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [7], "c": [3]}))
        pushed = await recv(s)
        assert names_of(pushed) == ["b"]
        # The version still names the whole set, as every replica computes it.
        assert pushed.version_info == make_snapshot({"a": [1], "b": [7], "c": [3]}).version(
            ENDPOINT
        )


async def test_named_subscription_waits_for_a_name_that_does_not_exist(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["later"])
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "later": [9]}))
        assert names_of(await recv(s)) == ["later"]


async def test_cds_full_set_shrinks_on_removal(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        response = await recv(s)
        assert sorted(names_of(response)) == ["a", "b"]
        await s.ack(response)
        ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
        assert names_of(await recv(s)) == ["a"]


async def test_all_types_change_pushed_cds_eds_lds_rds(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await join(s, ["a"], ["ingress-routes"])
        ads.cache.set_snapshot(
            "default",
            Snapshot.from_messages(
                {
                    CLUSTER: [make_cluster("a", timeout_ms=500), make_cluster("b")],
                    ENDPOINT: [make_endpoints("a", [2]), make_endpoints("b", [3])],
                    LISTENER: [make_listener("ingress", "ingress-routes", port=10001)],
                    ROUTE: [make_route("ingress-routes", "b")],
                }
            ),
        )
        order = [(await recv(s)).type_url for _ in range(4)]
        assert order == [CLUSTER, ENDPOINT, LISTENER, ROUTE]


async def test_removals_come_after_the_routes_that_stop_using_them(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}, route_to="b"))
    async with ads.sotw("envoy-1") as s:
        await join(s, ["a", "b"], ["ingress-routes"])
        # Cluster b goes away and the route moves to a: CDS keeps b until RDS has moved.
        ads.cache.set_snapshot("default", make_snapshot({"a": [3]}, route_to="a"))
        pushes = [await recv(s) for _ in range(4)]
        assert [p.type_url for p in pushes] == [CLUSTER, ENDPOINT, ROUTE, CLUSTER]
        assert sorted(names_of(pushes[0])) == ["a", "b"]
        assert names_of(pushes[3]) == ["a"]
        assert pushes[3].version_info == ads.cache.snapshot_for("default").version(CLUSTER)  # type: ignore[union-attr]


async def test_eds_request_after_cds_change_is_answered_even_if_unchanged(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        got = await join(s, ["a"], ["ingress-routes"])
        # Cluster a is rebuilt (new timeout) with the same endpoints: Envoy re-requests EDS for
        # it with the same names and waits for the ClusterLoadAssignment to finish warming.
        messages = make_messages({"a": [1]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900)]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        cds = await recv(s)
        assert cds.type_url == CLUSTER
        await s.ack(cds)
        await s.expect_silence()
        eds = got[ENDPOINT]
        await s.send(ENDPOINT, ["a"], version=eds.version_info, nonce=eds.nonce)
        answer = await recv(s)
        assert answer.type_url == ENDPOINT and answer.version_info == eds.version_info
        assert names_of(answer) == ["a"]


async def test_eds_push_in_the_round_of_a_cluster_rebuild_carries_that_cluster_too(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await join(s, ["a", "b"], ["ingress-routes"])
        # One round: cluster a rebuilt with the same endpoints, b's endpoints changed. The EDS
        # push must not be cut to b alone: a warms until its assignment arrives, and Envoy's
        # re-request for it comes with a nonce that is stale by then.
        messages = make_messages({"a": [1], "b": [3]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900), make_cluster("b")]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        cds = await recv(s)
        assert cds.type_url == CLUSTER
        eds = await recv(s)
        assert eds.type_url == ENDPOINT and names_of(eds) == ["a", "b"]


async def test_eds_push_while_a_re_request_is_owed_carries_the_whole_set(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await join(s, ["a", "b"], ["ingress-routes"])
        # Cluster a rebuilt alone: Envoy will re-request EDS for it ...
        messages = make_messages({"a": [1], "b": [2]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900), make_cluster("b")]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        await s.ack(await recv(s, CLUSTER))
        # ... but b's endpoints change first: that push answers the owed re-request too.
        messages = make_messages({"a": [1], "b": [3]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900), make_cluster("b")]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        eds = await recv(s)
        assert eds.type_url == ENDPOINT and names_of(eds) == ["a", "b"]


async def test_a_request_to_answer_is_answered_after_a_nack(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        first = (await join(s, ["a"], ["ingress-routes"]))[ENDPOINT]
        ads.cache.set_snapshot("default", make_snapshot({"a": [2]}))
        rejected = await recv(s, ENDPOINT)
        await s.nack(rejected, "bad endpoint", good_version=first.version_info, names=["a"])
        await s.expect_silence()
        # Cluster a is rebuilt: it warms until Envoy's EDS re-request is answered, although
        # the EDS version is still the one it rejected.
        messages = make_messages({"a": [2]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900)]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        await s.ack(await recv(s, CLUSTER))
        await s.send(ENDPOINT, ["a"], version=first.version_info, nonce=rejected.nonce)
        answer = await recv(s)
        assert answer.type_url == ENDPOINT and names_of(answer) == ["a"]


async def test_reconnect_with_the_current_version_is_not_resent(ads: RunningServer) -> None:
    snapshot = make_snapshot({"a": [1]})
    ads.cache.set_snapshot("default", snapshot)
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER, version=snapshot.version(CLUSTER))
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
        assert sorted(names_of(await recv(s))) == ["a", "b"]


async def test_fleets_get_their_own_snapshots_and_unknown_fleets_the_default(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"shared": [1]}))
    ads.cache.set_snapshot("gpu", make_snapshot({"gpu-pool": [2]}))
    async with (
        ads.sotw("e1", "gpu") as gpu,
        ads.sotw("e2", "cpu") as cpu,
        ads.sotw("e3", "default") as default,
    ):
        for s in (gpu, cpu, default):
            await s.send(CLUSTER)
        assert names_of(await recv(gpu)) == ["gpu-pool"]
        assert names_of(await recv(cpu)) == ["shared"]
        assert names_of(await recv(default)) == ["shared"]
        # A change to one fleet reaches only that fleet.
        ads.cache.set_snapshot("gpu", make_snapshot({"gpu-pool": [2], "gpu-2": [3]}))
        assert sorted(names_of(await recv(gpu))) == ["gpu-2", "gpu-pool"]
        await cpu.expect_silence(0.1)
        await default.expect_silence(0.1)
        assert {c.node_id: c.fleet for c in ads.status.connections()} == {
            "e1": "gpu",
            "e2": "cpu",
            "e3": "default",
        }


async def test_stuck_envoy_does_not_block_set_snapshot_or_other_streams(
    ads: RunningServer,
) -> None:
    def big(port: int) -> Snapshot:
        # ~150 KB of endpoints per response: a few of these fill the HTTP/2 windows.
        return make_snapshot({"a": list(range(port, port + 10_000))})

    ads.cache.set_snapshot("default", big(1))
    stuck = ads.sotw("stuck", read=False, **{"grpc.http2.bdp_probe": 0})
    async with stuck, ads.sotw("healthy") as healthy:
        await stuck.send(ENDPOINT, ["a"])
        await healthy.send(ENDPOINT, ["a"])
        await recv(healthy)
        last = None
        for round_ in range(2, 30):
            last = big(round_ * 10_000)
            ads.cache.set_snapshot("default", last)  # returns at once, never awaits a stream
            response = await recv(healthy)
            assert response.version_info == last.version(ENDPOINT)
        # The stuck stream's writer is parked on flow control, far behind.
        [stuck_conn] = ads.status.find("stuck")
        assert stuck_conn.types[ENDPOINT].version_sent != last.version(ENDPOINT)  # type: ignore[union-attr]
        # When it reads again it catches up to the newest snapshot, not a backlog.
        stuck.start_reading()
        async with asyncio.timeout(10):
            while (await stuck.recv()).version_info != last.version(ENDPOINT):  # type: ignore[union-attr]
                pass


async def test_shutdown_ends_streams_cleanly() -> None:
    server = RunningServer()
    await server.__aenter__()
    server.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with server.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        await recv(s)
        assert server.metric("kvpilot_xds_streams", mode="sotw") == 1
        await server.stop(grace=5)
        await asyncio.wait_for(s.ended.wait(), 5)
        assert await s.call.code() == grpc.StatusCode.OK
    assert server.status.connections() == []
    assert server.metric("kvpilot_xds_streams", mode="sotw") == 0


async def test_push_latency_is_observed_for_snapshot_changes(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        before = metric(ads, "kvpilot_xds_push_seconds_count")
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
        await recv(s)
        await poll(lambda: metric(ads, "kvpilot_xds_push_seconds_count") == before + 1)


async def test_status_listener_sees_connect_nack_and_disconnect(ads: RunningServer) -> None:
    events: list[tuple[str, str]] = []
    ads.status.add_listener(lambda event, conn: events.append((event, conn.node_id)))
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        await s.nack(await recv(s), "nope")
        await poll(lambda: ("nacked", "envoy-1") in events)
    await poll(lambda: ("disconnected", "envoy-1") in events)
    assert events[0] == ("connected", "envoy-1")


def two_listeners(clusters: dict[str, list[int]], bad_port: int | None) -> Snapshot:
    """`make_snapshot(clusters)`, plus a second listener "bad" on `bad_port` when one is given."""
    messages = make_messages(clusters)
    if bad_port is not None:
        messages[LISTENER].append(make_listener("bad", "ingress-routes", port=bad_port))
    return Snapshot.from_messages(messages)


async def answer_all(s: SotwStream, rejected: set[str], *, within: float = 0.5) -> list[Any]:
    """Answer every response until the stream goes quiet, like Envoy: NACK the LDS versions in
    `rejected`, ACK the rest. Returns the responses, in order."""
    seen = []
    while True:
        try:
            response = await recv(s, within=within)
        except TimeoutError:
            return seen
        seen.append(response)
        if response.type_url == LISTENER and response.version_info in rejected:
            await s.nack(response, "cannot bind: address in use")
        else:
            await s.ack(response)


async def test_a_rejected_listener_version_is_not_sent_again_when_the_change_is_undone(
    ads: RunningServer,
) -> None:
    good = two_listeners({"a": [1]}, None)
    ads.cache.set_snapshot("default", good)
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv(s))
        await s.send(LISTENER)
        await s.ack(await recv(s))
        # A policy adds a cluster and a listener the Envoy cannot bind: it NACKs the listener.
        bad = two_listeners({"a": [1], "b": [2]}, 10_001)
        ads.cache.set_snapshot("default", bad)
        await answer_all(s, {bad.version(LISTENER)})
        # The policy is deleted. The make-before-break round starts from what the Envoy runs,
        # so the rejected listener set does not come back inside a union.
        ads.cache.set_snapshot("default", good)
        again = await answer_all(s, {bad.version(LISTENER)})
        assert [r.version_info for r in again if r.type_url == LISTENER] == [good.version(LISTENER)]
        assert metric(ads, "kvpilot_xds_nacks_total", type="LDS", fleet="default") == 1
        [conn] = ads.status.find("envoy-1")
        assert conn.types[LISTENER].version_acked == good.version(LISTENER)


async def test_a_nack_of_the_earlier_response_of_a_round_is_counted_and_then_resolved(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}, route_to="b"))
    async with ads.sotw("envoy-1") as s:
        await join(s, ["a", "b"], ["ingress-routes"])
        ads.cache.set_snapshot("default", make_snapshot({"a": [3]}, route_to="a"))
        union, eds, rds, final = [await recv(s) for _ in range(4)]
        assert (union.type_url, final.type_url) == (CLUSTER, CLUSTER)
        # Envoy answers in order: the union's NACK carries a nonce that is no longer the latest.
        await s.nack(union, "cluster b: bad")
        for response in (eds, rds, final):
            await s.ack(response)
        await poll(lambda: metric(ads, "kvpilot_xds_nacks_total", type="CDS", fleet="default") == 1)
        await poll(
            lambda: ads.status.find("envoy-1")[0].types[CLUSTER].version_acked == final.version_info
        )
        [conn] = ads.status.find("envoy-1")
        nack = conn.types[CLUSTER].last_nack
        assert nack is not None and nack.version == union.version_info
        # The Envoy runs a later version now: the NACK shows as resolved, with when.
        assert nack.resolved_at is not None and nack.resolved_by == final.version_info
        [view] = ads.status.as_dict()["connections"]
        resolved = view["types"][CLUSTER]["last_nack"]["resolved"]
        assert resolved == {"version": final.version_info, "at": nack.resolved_at}
