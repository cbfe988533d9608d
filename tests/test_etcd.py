"""EtcdClient against a real etcd: KV, compare-and-swap, leases, watches, endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from harness.processes import frozen
from harness.wait import poll

from controlplane.etcd import (
    CompactedError,
    ConflictError,
    EtcdClient,
    EtcdClosed,
    EtcdUnavailable,
    EventType,
    LeaseNotFoundError,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)
from controlplane.etcd.security import access_problem
from controlplane.local import EmbeddedEtcd, free_port

pytestmark = pytest.mark.e2e

T = TypeVar("T")


@pytest.fixture
async def client(etcd: EmbeddedEtcd) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint], timeout=5.0) as c:
        yield c


@pytest.fixture
def prefix(etcd_prefix: str) -> bytes:
    return etcd_prefix.encode() + b"/"


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"/a/", b"/a0"), (b"a\xff", b"b"), (b"\xff\xff", b"\x00"), (b"", b"\x00")],
)
def test_prefix_range_end(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end


async def test_put_get_roundtrip_carries_revisions(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"k"
    assert await client.get(key) is None
    rev1 = await client.put(key, b"v1")
    kv = await client.get(key)
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.version, kv.lease) == (
        key,
        b"v1",
        rev1,
        rev1,
        1,
        0,
    )
    rev2 = await client.put(key, b"v2")
    kv2 = await client.get(key)
    assert kv2 is not None and kv2.value == b"v2"
    assert kv2.mod_revision == rev2 > rev1 and kv2.create_revision == rev1 and kv2.version == 2


async def test_create_fails_when_key_exists(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"k"
    rev = await client.put(key, b"a", expect_mod_revision=0)
    with pytest.raises(ConflictError) as info:
        await client.put(key, b"b", expect_mod_revision=0)
    assert info.value.key == key and info.value.actual_mod_revision == rev
    assert "already exists" in str(info.value)
    kv = await client.get(key)
    assert kv is not None and kv.value == b"a"


async def test_replace_with_stale_revision_conflicts(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"k"
    rev1 = await client.put(key, b"a")
    rev2 = await client.put(key, b"b", expect_mod_revision=rev1)
    with pytest.raises(ConflictError) as info:
        await client.put(key, b"c", expect_mod_revision=rev1)
    assert info.value.actual_mod_revision == rev2
    with pytest.raises(ConflictError) as missing:
        await client.put(prefix + b"missing", b"c", expect_mod_revision=rev1)
    assert missing.value.actual_mod_revision == 0


async def test_exactly_one_of_two_concurrent_replaces_wins(
    client: EtcdClient, prefix: bytes
) -> None:
    key = prefix + b"k"
    rev = await client.put(key, b"base")
    results = await asyncio.gather(
        client.put(key, b"left", expect_mod_revision=rev),
        client.put(key, b"right", expect_mod_revision=rev),
        return_exceptions=True,
    )
    wins = [r for r in results if isinstance(r, int)]
    conflicts = [r for r in results if isinstance(r, ConflictError)]
    assert len(wins) == 1 and len(conflicts) == 1, results
    assert conflicts[0].actual_mod_revision == wins[0]
    kv = await client.get(key)
    assert kv is not None and kv.mod_revision == wins[0]


async def test_delete_with_revision(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"k"
    rev1 = await client.put(key, b"a")
    rev2 = await client.put(key, b"b")
    with pytest.raises(ConflictError) as info:
        await client.delete(key, expect_mod_revision=rev1)
    assert info.value.actual_mod_revision == rev2
    assert await client.delete(key, expect_mod_revision=rev2) is True
    assert await client.get(key) is None
    assert await client.delete(key) is False


async def test_get_prefix_is_sorted_and_paginates(client: EtcdClient, prefix: bytes) -> None:
    import controlplane.etcd.client as etcd_module

    keys = [prefix + f"k{i:04d}".encode() for i in range(25)]
    for key in reversed(keys):
        await client.put(key, key[-5:])
    await client.put(prefix[:-1] + b"0-outside", b"x")  # just past the prefix
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(etcd_module, "_RANGE_PAGE_SIZE", 7)
        kvs, revision = await client.get_prefix(prefix)
    assert [kv.key for kv in kvs] == keys
    assert revision >= max(kv.mod_revision for kv in kvs)
    assert await client.delete_prefix(prefix) == 25
    assert (await client.get_prefix(prefix))[0] == []
    await client.delete(prefix[:-1] + b"0-outside")


async def test_lease_expiry_removes_key(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"leased"
    lease = await client.grant_lease(1)
    await client.put(key, b"v", lease=lease)
    kv = await client.get(key)
    assert kv is not None and kv.lease == lease
    assert await client.keepalive_once(lease) > 0
    assert await client.lease_time_to_live(lease) > 0

    async def gone() -> bool:
        return await client.get(key) is None

    await poll(gone, within=10, message="leased key expires")
    assert await client.keepalive_once(lease) == 0
    assert await client.lease_time_to_live(lease) == 0
    with pytest.raises(LeaseNotFoundError):
        await client.put(key, b"v", lease=lease)


async def test_revoke_lease_deletes_keys(client: EtcdClient, prefix: bytes) -> None:
    lease = await client.grant_lease(60)
    await client.put(prefix + b"a", b"v", lease=lease)
    await client.revoke_lease(lease)
    assert await client.get(prefix + b"a") is None
    await client.revoke_lease(lease)  # already gone: not an error


async def test_keepalive_forever_keeps_lease_and_revokes_on_exit(
    client: EtcdClient, prefix: bytes
) -> None:
    key = prefix + b"kept"
    async with client.keepalive_forever(1) as keeper:
        await client.put(key, b"v", lease=keeper.lease_id)
        lease = keeper.lease_id
        # Outlive the TTL a few times over; the key must stay.
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.5
        while loop.time() < end:
            assert await client.get(key) is not None
            await asyncio.sleep(0.1)
        assert keeper.regrants == 0
    assert await client.keepalive_once(lease) == 0
    assert await client.get(key) is None


async def test_keepalive_forever_regrants_lost_lease_and_retries_owner(
    client: EtcdClient, prefix: bytes
) -> None:
    key = prefix + b"regranted"
    regranted: list[int] = []

    async def rewrite(lease_id: int) -> None:
        regranted.append(lease_id)
        if len(regranted) == 1:  # the owner's first rewrite fails: it must be retried
            raise EtcdUnavailable("etcd went away again")
        await client.put(key, b"again", lease=lease_id)

    async with client.keepalive_forever(2, on_regrant=rewrite) as keeper:
        first = keeper.lease_id
        await client.revoke_lease(first)  # as if etcd was down longer than the TTL

        async def rewritten() -> bool:
            kv = await client.get(key)
            return kv is not None and kv.lease == keeper.lease_id != first

        await poll(rewritten, message="lease re-granted and key rewritten")
        assert regranted == [keeper.lease_id] * 2 and keeper.regrants == 1


async def test_keepalive_forever_stops_when_its_client_is_closed(
    etcd: EmbeddedEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    # A closed client never works again: retrying would keep the owner's exit (or a test's
    # teardown) waiting on a keeper whose cancellation a gRPC call swallowed. Nor is it worth
    # a warning: the lease is left to expire.
    c = EtcdClient([etcd.endpoint], timeout=1.0)
    await c.connect()
    async with c.keepalive_forever(1) as keeper:
        await c.close()
        await poll(lambda: not keeper.running, message="the keeper to stop")
        assert keeper.last_error is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def collect(
    watch: AsyncIterator[WatchBatch], count: int, within: float = 10.0
) -> list[WatchBatch]:
    """Read batches until ``count`` events have arrived (the empty opening batch excluded)."""
    batches: list[WatchBatch] = []
    seen = 0
    async with asyncio.timeout(within):
        async for batch in watch:
            if batch:
                batches.append(batch)
                seen += len(batch)
            if seen >= count:
                break
    return batches


async def test_watch_yields_events_in_revision_order(client: EtcdClient, prefix: bytes) -> None:
    start = await client.put(prefix + b"a", b"1")
    await client.put(prefix + b"b", b"2")
    await client.put(prefix + b"a", b"3")
    await client.delete(prefix + b"b")
    await client.put(b"/elsewhere" + prefix, b"not watched")

    watch = client.watch_prefix(prefix, start_revision=start)
    try:
        batches = await collect(watch, 4)
        events: list[WatchEvent] = [e for b in batches for e in b]
        assert [(e.type, e.kv.key, e.kv.value) for e in events] == [
            (EventType.PUT, prefix + b"a", b"1"),
            (EventType.PUT, prefix + b"b", b"2"),
            (EventType.PUT, prefix + b"a", b"3"),
            (EventType.DELETE, prefix + b"b", b""),
        ]
        revisions = [e.kv.mod_revision for e in events]
        assert revisions == sorted(revisions) and revisions[0] == start
        assert batches[-1].revision == revisions[-1]

        # Live events, after the catch-up.
        live = await client.put(prefix + b"c", b"4")
        (batch,) = await collect(watch, 1)
        assert [(e.kv.key, e.kv.mod_revision) for e in batch] == [(prefix + b"c", live)]
        assert batch.revision == live
    finally:
        await watch.aclose()  # type: ignore[attr-defined]
    await client.delete(b"/elsewhere" + prefix)


async def test_watch_from_compacted_revision_raises(client: EtcdClient, prefix: bytes) -> None:
    old = await client.put(prefix + b"a", b"1")
    latest = await client.put(prefix + b"a", b"2")
    await client.compact(latest)
    with pytest.raises(CompactedError) as info:
        async for _ in client.watch_prefix(prefix, start_revision=old):
            pass
    assert info.value.compact_revision == latest
    assert "re-list" in str(info.value)


async def test_cancelling_watch_task_cancels_watch(client: EtcdClient, prefix: bytes) -> None:
    opened = asyncio.Event()

    async def follow() -> None:
        async for _ in client.watch_prefix(prefix, start_revision=0):
            opened.set()

    task = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        await opened.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.put(prefix + b"after", b"x")  # the client still works


async def test_a_watch_under_way_when_its_client_closes_raises_etcd_closed(
    etcd: EmbeddedEtcd, prefix: bytes
) -> None:
    # Closing a channel cancels its calls in flight, and gRPC raises that as a CancelledError
    # in a task nobody cancelled: a loop would end as if cancelled instead of on EtcdClosed.
    c = EtcdClient([etcd.endpoint], timeout=5.0)
    await c.connect()
    opened = asyncio.Event()

    async def follow() -> None:
        async for _ in c.watch_prefix(prefix, start_revision=0):
            opened.set()

    task = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        await opened.wait()
    await c.close()
    with pytest.raises(EtcdClosed):
        async with asyncio.timeout(10):
            await task


async def test_a_read_under_way_when_its_client_closes_raises_etcd_closed_unless_cancelled(
    tmp_path: Path,
) -> None:
    server = EmbeddedEtcd(tmp_path).start()
    try:
        c = EtcdClient([server.endpoint], timeout=30.0)
        await c.connect()
        await c.get(b"/k")  # the channel is up
        with frozen(server):
            left, cancelled = (asyncio.create_task(c.get(b"/k")) for _ in range(2))
            await asyncio.sleep(0)  # one turn of the loop sends both; etcd answers neither
            cancelled.cancel()
            await c.close()
            outcomes = await asyncio.gather(left, cancelled, return_exceptions=True)
        assert [type(outcome) for outcome in outcomes] == [EtcdClosed, asyncio.CancelledError]
    finally:
        server.stop()


async def test_status_reports_revision_and_leader(client: EtcdClient, prefix: bytes) -> None:
    rev = await client.put(prefix + b"s", b"x")
    status = await client.status()
    assert status.revision >= rev
    assert status.has_leader and status.leader == status.member_id
    assert status.version.startswith("3.")


async def test_first_endpoint_dead_still_works(etcd: EmbeddedEtcd, prefix: bytes) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with EtcdClient([dead, f"http://{etcd.endpoint}"], timeout=5.0) as c:
        rev = await c.put(prefix + b"k", b"v", expect_mod_revision=0)
        kv = await c.get(prefix + b"k")
        assert kv is not None and kv.mod_revision == rev
        assert c.current_endpoint == etcd.endpoint
        watch = c.watch_prefix(prefix, start_revision=rev)
        try:
            (batch,) = await collect(watch, 1)
            assert batch[0].kv.key == prefix + b"k"
        finally:
            await watch.aclose()  # type: ignore[attr-defined]


async def test_unreachable_etcd_raises_unavailable_within_timeout() -> None:
    async with EtcdClient([f"127.0.0.1:{free_port()}"], timeout=0.5) as c:
        loop = asyncio.get_running_loop()
        started = loop.time()
        # A generous deadline: what matters is that both calls end with the error rather
        # than wait for etcd forever; how long they took is reported.
        async with asyncio.timeout(60):
            with pytest.raises(EtcdUnavailable, match="cannot reach etcd"):
                await c.get(b"/x")
            with pytest.raises(EtcdUnavailable):
                async for _ in c.watch_prefix(b"/x", start_revision=0):
                    pass
        print(f"both failed {loop.time() - started:.2f}s in (timeout 0.5 s)")


async def test_watch_breaks_with_unavailable_and_client_recovers(tmp_path: Path) -> None:
    server = EmbeddedEtcd(tmp_path).start()
    try:
        async with EtcdClient([server.endpoint], timeout=10.0) as c:
            rev = await c.put(b"/r/a", b"1")
            watch = c.watch_prefix(b"/r/", start_revision=rev + 1)
            with pytest.raises(EtcdUnavailable, match="broke"):
                async with asyncio.timeout(20):
                    async for batch in watch:
                        if not batch:  # established
                            await asyncio.to_thread(server.kill)
            await asyncio.to_thread(server.start)
            # Same data dir and ports: history survives, and calls reconnect.
            kv = await c.get(b"/r/a")
            assert kv is not None and kv.mod_revision == rev
    finally:
        with contextlib.suppress(Exception):
            server.stop()


@pytest.mark.parametrize(
    ("details", "about_credentials"),
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "
            "tcp handshaker shutdown",
            False,
        ),
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:2379: "
            "Ssl handshake failed: SSL_ERROR_SSL: error:1000007d:SSL routines",
            True,
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "
            "Handshake failed",
            True,
        ),
    ],
)
def test_a_tcp_connect_given_up_is_not_taken_for_a_tls_problem(
    details: str, about_credentials: bool
) -> None:
    # Seen under load: a plaintext etcd's slow TCP connect reported as "tcp handshaker
    # shutdown", which was read as a TLS handshake failure and ended the call unretried.
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    assert (access_problem(error) is not None) == about_credentials
