"""ADS state of the world (StreamAggregatedResources) against a real grpc.aio server: ACKs
and NACKs, nonces, subscriptions and what each push carries (the server side of it, fleets
and streams, is test_ads_sotw_server)."""

from __future__ import annotations

from typing import Any

import pytest
from harness.wait import poll
from harness.xdsclient import (
    RunningServer,
    SotwStream,
    join_like_envoy,
    make_cluster,
    make_endpoints,
    make_listener,
    make_messages,
    make_route,
    make_snapshot,
    names_of,
    recv_well_formed,
    unpack,
)

from xdsserver import stream
from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from xdsserver.snapshot import Snapshot


async def test_ack_records_the_version_and_triggers_no_resend(ads: RunningServer) -> None:
    snapshot = make_snapshot({"a": [1], "b": [2]})
    ads.cache.set_snapshot("default", snapshot)
    async with ads.sotw("envoy-1") as s:
        got = await join_like_envoy(s, ["a", "b"], ["ingress-routes"])
        for type_url, response in got.items():
            # version_info is the snapshot's content hash for the type (rule 2).
            assert response.version_info == snapshot.version(type_url)
        assert len({r.nonce for r in got.values()}) == 4
        await s.expect_silence()
        [conn] = ads.status.connections()
        assert conn.node_id == "envoy-1" and conn.fleet == "default" and conn.mode == "sotw"
        assert conn.types[CLUSTER].version_acked == snapshot.version(CLUSTER)
        assert conn.types[ENDPOINT].resource_names == ["a", "b"]
        assert ads.metric("kvpilot_xds_acks_total", type="CDS") == 1
        assert ads.metric("kvpilot_xds_pushes_total", type="EDS") == 1


async def test_wildcard_cds_gets_all_and_named_eds_only_what_it_asks(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2], "c": [3]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER, [])
        assert sorted(names_of(await recv_well_formed(s))) == ["a", "b", "c"]
    async with ads.sotw("envoy-2") as s:
        await s.send(CLUSTER, ["*"])
        assert sorted(names_of(await recv_well_formed(s))) == ["a", "b", "c"]
        await s.send(ENDPOINT, ["b", "b"])
        response = await recv_well_formed(s)
        assert names_of(response) == ["b"]
        assert unpack(response.resources[0]) == make_endpoints("b", [2])


async def test_nack_is_recorded_and_never_answered_with_the_same_config(
    ads: RunningServer,
) -> None:
    bad = make_snapshot({"a": [1]})
    ads.cache.set_snapshot("default", bad)
    async with ads.sotw("envoy-1") as s, ads.sotw("envoy-2") as other:
        first = (await join_like_envoy(s, ["a"], ["ingress-routes"]))[ENDPOINT]
        await join_like_envoy(other, ["a"], ["ingress-routes"])

        ads.cache.set_snapshot("default", make_snapshot({"a": [2]}))
        rejected = await recv_well_formed(s, ENDPOINT)
        await other.ack(await recv_well_formed(other, ENDPOINT), ["a"])
        await s.nack(rejected, "bad endpoint", good_version=first.version_info, names=["a"])
        await s.expect_silence()  # no resend of the rejected config

        [conn] = ads.status.find("envoy-1")
        nack = conn.types[ENDPOINT].last_nack
        assert nack is not None
        assert nack.message == "bad endpoint" and nack.version == rejected.version_info
        assert conn.types[ENDPOINT].version_acked == first.version_info
        [peer] = ads.status.find("envoy-2")
        assert peer.types[ENDPOINT].last_nack is None
        assert ads.metric("kvpilot_xds_nacks_total", type="EDS", fleet="default") == 1
        json_view = ads.status.as_dict()["connections"]
        assert any(c["types"][ENDPOINT]["last_nack"] for c in json_view)

        # The next different version flows normally, to both.
        fixed = make_snapshot({"a": [3]})
        ads.cache.set_snapshot("default", fixed)
        assert (await recv_well_formed(s, ENDPOINT)).version_info == fixed.version(ENDPOINT)
        assert (await recv_well_formed(other, ENDPOINT)).version_info == fixed.version(ENDPOINT)


async def test_stale_nonce_is_ignored(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["a"])
        old = await recv_well_formed(s)
        ads.cache.set_snapshot("default", make_snapshot({"a": [5], "b": [2]}))
        new = await recv_well_formed(s)
        assert new.nonce != old.nonce
        # A request carrying the older nonce (sent before it saw `new`) is ignored entirely.
        await s.send(ENDPOINT, ["a", "b"], version=old.version_info, nonce=old.nonce)
        await s.expect_silence()
        # The same request with the latest nonce is acted upon.
        await s.send(ENDPOINT, ["a", "b"], version=new.version_info, nonce=new.nonce)
        assert sorted(names_of(await recv_well_formed(s))) == ["a", "b"]


async def test_requested_name_is_pushed_when_it_appears(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["a", "later"])
        response = await recv_well_formed(s)
        assert names_of(response) == ["a"]
        await s.ack(response, ["a", "later"])
        await ads.settled("envoy-1", response)
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "later": [9]}))
        # A push of a named type carries only what changed; Envoy keeps "a".
        assert names_of(await recv_well_formed(s)) == ["later"]


async def test_eds_push_carries_only_the_changed_assignments(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2], "c": [3]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(ENDPOINT, ["a", "b", "c"])
        response = await recv_well_formed(s)
        assert names_of(response) == ["a", "b", "c"]
        await s.ack(response, ["a", "b", "c"])
        await ads.settled("envoy-1", response)
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [7], "c": [3]}))
        pushed = await recv_well_formed(s)
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
        assert names_of(await recv_well_formed(s)) == ["later"]


async def test_cds_full_set_shrinks_on_removal(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        response = await recv_well_formed(s)
        assert sorted(names_of(response)) == ["a", "b"]
        await s.ack(response)
        ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
        assert names_of(await recv_well_formed(s)) == ["a"]


async def test_all_types_change_pushed_cds_eds_lds_rds(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a"], ["ingress-routes"])
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
        cds, eds = await recv_well_formed(s), await recv_well_formed(s)
        assert [cds.type_url, eds.type_url] == [CLUSTER, ENDPOINT]
        # Cluster b is new: Envoy serves a route to it with 503 NC until it warmed, and says
        # it did by answering the CDS response. The listener and routes wait for that.
        await s.expect_silence()
        [conn] = ads.status.connections()
        assert conn.as_dict()["warming"]["clusters"] == ["b"]
        await s.ack(cds)
        order = [(await recv_well_formed(s)).type_url for _ in range(2)]
        assert order == [LISTENER, ROUTE]
        [conn] = ads.status.connections()
        assert conn.as_dict()["warming"] is None
        # Joining added cluster a: two waits in all.
        assert ads.metric("kvpilot_xds_cluster_warming_seconds_count") == 2


def moved_to(cluster: str) -> Snapshot:
    """Everything routed to `cluster`, the only cluster there is."""
    return make_snapshot({cluster: [2]}, route_to=cluster)


async def test_routes_wait_for_new_clusters_and_the_old_ones_wait_for_the_routes(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", moved_to("old"))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["old"], ["ingress-routes"])
        ads.cache.set_snapshot("default", moved_to("new"))
        union = await recv_well_formed(s)
        assert union.type_url == CLUSTER and sorted(names_of(union)) == ["new", "old"]
        # Envoy re-requests endpoints for the new cluster and warms it.
        await s.send(ENDPOINT, ["new", "old"])
        while not names_of(endpoints := await recv_well_formed(s, ENDPOINT)):
            pass  # the round's own push: nothing it was subscribed to is left
        assert names_of(endpoints) == ["new"]
        await s.expect_silence()
        await s.ack(union)
        route = await recv_well_formed(s)
        assert route.type_url == ROUTE
        final = await recv_well_formed(s)
        assert final.type_url == CLUSTER and names_of(final) == ["new"]
        assert final.version_info == ads.cache.snapshot_for("default").version(CLUSTER)  # type: ignore[union-attr]
        await s.ack(route, ["ingress-routes"])
        await s.ack(final)
        await s.expect_silence()


async def test_a_nack_of_the_new_clusters_lets_the_routes_go(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a"], ["ingress-routes"])
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}, route_to="b"))
        cds = await recv_well_formed(s, CLUSTER)
        await s.expect_silence()
        await s.nack(cds, "bad cluster")
        # Holding on would not warm anything: the Envoy keeps what it had.
        assert (await recv_well_formed(s, ROUTE)).type_url == ROUTE


async def test_routes_go_after_the_longest_wait_without_an_answer(
    ads: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "WARMING_HOLD_SECONDS", 0.2)
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a"], ["ingress-routes"])
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}, route_to="b"))
        await recv_well_formed(s, CLUSTER)
        # Never answered: the writer wakes by itself at the limit.
        assert (await recv_well_formed(s, ROUTE)).type_url == ROUTE
        assert ads.metric("kvpilot_xds_warming_timeouts_total", fleet="default") == 1
        [conn] = ads.status.connections()
        assert conn.as_dict()["warming"] is None


async def test_removals_come_after_the_routes_that_stop_using_them(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}, route_to="b"))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a", "b"], ["ingress-routes"])
        # Cluster b goes away and the route moves to a: CDS keeps b until RDS has moved.
        # (The Envoy runs a and b already: the union of old and new is not sent again.)
        ads.cache.set_snapshot("default", make_snapshot({"a": [3]}, route_to="a"))
        pushes = [await recv_well_formed(s) for _ in range(3)]
        assert [p.type_url for p in pushes] == [ENDPOINT, ROUTE, CLUSTER]
        assert names_of(pushes[2]) == ["a"]
        assert pushes[2].version_info == ads.cache.snapshot_for("default").version(CLUSTER)  # type: ignore[union-attr]


async def test_eds_request_after_cds_change_is_answered_even_if_unchanged(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        got = await join_like_envoy(s, ["a"], ["ingress-routes"])
        # Cluster a is rebuilt (new timeout) with the same endpoints: Envoy re-requests EDS for
        # it with the same names and waits for the ClusterLoadAssignment to finish warming.
        messages = make_messages({"a": [1]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900)]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        cds = await recv_well_formed(s)
        assert cds.type_url == CLUSTER
        await s.ack(cds)
        await s.expect_silence()
        eds = got[ENDPOINT]
        await s.send(ENDPOINT, ["a"], version=eds.version_info, nonce=eds.nonce)
        answer = await recv_well_formed(s)
        assert answer.type_url == ENDPOINT and answer.version_info == eds.version_info
        assert names_of(answer) == ["a"]


async def test_eds_push_in_the_round_of_a_cluster_rebuild_carries_that_cluster_too(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a", "b"], ["ingress-routes"])
        # One round: cluster a rebuilt with the same endpoints, b's endpoints changed. The EDS
        # push must not be cut to b alone: a warms until its assignment arrives, and Envoy's
        # re-request for it comes with a nonce that is stale by then.
        messages = make_messages({"a": [1], "b": [3]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900), make_cluster("b")]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        cds = await recv_well_formed(s)
        assert cds.type_url == CLUSTER
        eds = await recv_well_formed(s)
        assert eds.type_url == ENDPOINT and names_of(eds) == ["a", "b"]


async def test_eds_push_while_a_re_request_is_owed_carries_the_whole_set(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a", "b"], ["ingress-routes"])
        # Cluster a rebuilt alone: Envoy will re-request EDS for it ...
        messages = make_messages({"a": [1], "b": [2]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900), make_cluster("b")]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        await s.ack(await recv_well_formed(s, CLUSTER))
        # ... but b's endpoints change first: that push answers the owed re-request too.
        messages = make_messages({"a": [1], "b": [3]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900), make_cluster("b")]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        eds = await recv_well_formed(s)
        assert eds.type_url == ENDPOINT and names_of(eds) == ["a", "b"]


async def test_a_request_to_answer_is_answered_after_a_nack(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        first = (await join_like_envoy(s, ["a"], ["ingress-routes"]))[ENDPOINT]
        ads.cache.set_snapshot("default", make_snapshot({"a": [2]}))
        rejected = await recv_well_formed(s, ENDPOINT)
        await s.nack(rejected, "bad endpoint", good_version=first.version_info, names=["a"])
        await s.expect_silence()
        # Cluster a is rebuilt: it warms until Envoy's EDS re-request is answered, although
        # the EDS version is still the one it rejected.
        messages = make_messages({"a": [2]})
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900)]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        await s.ack(await recv_well_formed(s, CLUSTER))
        await s.send(ENDPOINT, ["a"], version=first.version_info, nonce=rejected.nonce)
        answer = await recv_well_formed(s)
        assert answer.type_url == ENDPOINT and names_of(answer) == ["a"]


async def test_reconnect_with_the_current_version_is_not_resent(ads: RunningServer) -> None:
    snapshot = make_snapshot({"a": [1]})
    ads.cache.set_snapshot("default", snapshot)
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER, version=snapshot.version(CLUSTER))
        await s.expect_silence()
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
        assert sorted(names_of(await recv_well_formed(s))) == ["a", "b"]


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
            response = await recv_well_formed(s, within=within)
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
        await s.ack(await recv_well_formed(s))
        await s.send(LISTENER)
        await s.ack(await recv_well_formed(s))
        # A policy adds a cluster and a listener the Envoy cannot bind: it NACKs the listener.
        bad = two_listeners({"a": [1], "b": [2]}, 10_001)
        ads.cache.set_snapshot("default", bad)
        await answer_all(s, {bad.version(LISTENER)})
        # The policy is deleted. The make-before-break round starts from what the Envoy runs,
        # so the rejected listener set does not come back inside a union.
        ads.cache.set_snapshot("default", good)
        again = await answer_all(s, {bad.version(LISTENER)})
        assert [r.version_info for r in again if r.type_url == LISTENER] == [good.version(LISTENER)]
        assert ads.metric("kvpilot_xds_nacks_total", type="LDS", fleet="default") == 1
        [conn] = ads.status.find("envoy-1")
        assert conn.types[LISTENER].version_acked == good.version(LISTENER)


async def test_a_nack_of_the_earlier_response_of_a_round_is_counted_and_then_resolved(
    ads: RunningServer,
) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}, route_to="b"))
    async with ads.sotw("envoy-1") as s:
        await join_like_envoy(s, ["a", "b"], ["ingress-routes"])
        # Cluster a is rebuilt as b goes: the union carries the new a and keeps b.
        messages = make_messages({"a": [3]}, route_to="a")
        messages[CLUSTER] = [make_cluster("a", timeout_ms=900)]
        ads.cache.set_snapshot("default", Snapshot.from_messages(messages))
        union, eds, rds, final = [await recv_well_formed(s) for _ in range(4)]
        assert sorted(names_of(union)) == ["a", "b"] and names_of(final) == ["a"]
        assert (union.type_url, final.type_url) == (CLUSTER, CLUSTER)
        # Envoy answers in order: the union's NACK carries a nonce that is no longer the latest.
        await s.nack(union, "cluster b: bad")
        for response in (eds, rds, final):
            await s.ack(response)
        await poll(lambda: ads.metric("kvpilot_xds_nacks_total", type="CDS", fleet="default") == 1)
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
