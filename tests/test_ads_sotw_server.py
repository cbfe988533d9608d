"""ADS state of the world as a server, against a real grpc.aio server: each fleet gets its
own snapshot, a stuck Envoy blocks nobody, shutdown ends streams cleanly, and push latency and
stream status are observed."""

from __future__ import annotations

import asyncio

import grpc
from harness.wait import poll
from harness.xdsclient import (
    RunningServer,
    make_snapshot,
    names_of,
    recv_well_formed,
)

from xdsserver.resources import CLUSTER, ENDPOINT
from xdsserver.snapshot import Snapshot


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
        assert names_of(await recv_well_formed(gpu)) == ["gpu-pool"]
        assert names_of(await recv_well_formed(cpu)) == ["shared"]
        assert names_of(await recv_well_formed(default)) == ["shared"]
        # A change to one fleet reaches only that fleet.
        ads.cache.set_snapshot("gpu", make_snapshot({"gpu-pool": [2], "gpu-2": [3]}))
        assert sorted(names_of(await recv_well_formed(gpu))) == ["gpu-2", "gpu-pool"]
        await cpu.expect_silence()
        await default.expect_silence()
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
        await recv_well_formed(healthy)
        last = None
        for round_ in range(2, 30):
            last = big(round_ * 10_000)
            ads.cache.set_snapshot("default", last)  # returns at once, never awaits a stream
            response = await recv_well_formed(healthy)
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
        await recv_well_formed(s)
        assert server.metric("kvpilot_xds_streams", mode="sotw") == 1
        await server.stop(grace=5)
        async with asyncio.timeout(5):
            await s.ended.wait()
        assert await s.call.code() == grpc.StatusCode.OK
    assert server.status.connections() == []
    assert server.metric("kvpilot_xds_streams", mode="sotw") == 0


async def test_push_latency_is_observed_for_snapshot_changes(ads: RunningServer) -> None:
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        await s.ack(await recv_well_formed(s))
        before = ads.metric("kvpilot_xds_push_seconds_count")
        ads.cache.set_snapshot("default", make_snapshot({"a": [1], "b": [2]}))
        await recv_well_formed(s)
        await poll(lambda: ads.metric("kvpilot_xds_push_seconds_count") == before + 1)


async def test_status_listener_sees_connect_nack_and_disconnect(ads: RunningServer) -> None:
    events: list[tuple[str, str]] = []
    ads.status.add_listener(lambda event, conn: events.append((event, conn.node_id)))
    ads.cache.set_snapshot("default", make_snapshot({"a": [1]}))
    async with ads.sotw("envoy-1") as s:
        await s.send(CLUSTER)
        await s.nack(await recv_well_formed(s), "nope")
        await poll(lambda: ("nacked", "envoy-1") in events)
    await poll(lambda: ("disconnected", "envoy-1") in events)
    assert events[0] == ("connected", "envoy-1")
