"""Store, StateMirror and the replica's publishers against a real etcd, including etcd restarts
and compaction."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from harness.builders import pool
from harness.wait import poll
from prometheus_client import CollectorRegistry

from controlplane.envoystatus import StatusPublisher
from controlplane.etcd import ConflictError, EtcdClient
from controlplane.etcd.keys import InvalidName, Keys, UnknownKind, decode_json
from controlplane.etcd.store import AlreadyExists, InvalidValue, NotFound, RevisionMismatch, Store
from controlplane.local import EmbeddedEtcd, free_port
from controlplane.mirror import StateChange, StateMirror
from controlplane.rollouts.signals import SignalPublisher, signals_key
from xdsserver.signals import SignalBook
from xdsserver.status import ConnectionRegistry

pytestmark = pytest.mark.e2e


@pytest.fixture
async def client(etcd: EmbeddedEtcd) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint]) as c:
        yield c


@pytest.fixture
def store(client: EtcdClient, etcd_prefix: str) -> Store:
    return Store(client, etcd_prefix)


class Recorder:
    """An ``on_change`` callback that keeps what it was told."""

    def __init__(self) -> None:
        self.changes: list[StateChange] = []

    async def __call__(self, change: StateChange) -> None:
        self.changes.append(change)


@contextlib.asynccontextmanager
async def running(mirror: StateMirror) -> AsyncIterator[StateMirror]:
    task = asyncio.create_task(mirror.run())
    try:
        await mirror.wait_synced(10)
        yield mirror
    finally:
        task.cancel()
        # Bounded: a mirror that ignores its cancellation fails here, not at the suite's timeout.
        async with asyncio.timeout(10):
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- key layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda k: k.object("Pool", "a"), "objects/pools/a"),
        (lambda k: k.object("routingpolicies", "p"), "objects/routingpolicies/p"),
        (lambda k: k.object("Fleet", "edge"), "objects/fleets/edge"),
        (lambda k: k.endpoint("gpu", "e1"), "endpoints/gpu/e1"),
        (lambda k: k.telemetry("gpu", "e1"), "telemetry/gpu/e1"),
        (lambda k: k.envoy_status("cp-0", "envoy-1"), "status/envoys/cp-0/envoy-1"),
    ],
)
def test_key_layout(make: Callable[[Keys], str], expected: str) -> None:
    keys = Keys("/kvpilot/")
    assert make(keys) == expected
    assert keys.absolute(expected) == b"/kvpilot/" + expected.encode()
    assert keys.relative(keys.absolute(expected)) == expected


@pytest.mark.parametrize("name", ["", "a/b", "..", "tab\there"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidName, match="no '/'"):
        Keys().object("Pool", name)


def test_unknown_kind_lists_known_ones() -> None:
    with pytest.raises(UnknownKind, match="known kinds: Budget, Fleet, Pool"):
        Keys().object("Widget", "w")


def test_decode_json_never_raises() -> None:
    assert decode_json(b'{"a": 1}') == {"a": 1}
    assert decode_json(b"[1]") is None
    assert decode_json(b"\xff garbage") is None


# -- objects ---------------------------------------------------------------------------------


async def test_create_get_replace_delete(store: Store) -> None:
    created = await store.create("Pool", "a", pool("a", lb="ring_hash"))
    assert created.revision == created.created_revision and created.kind == "Pool"
    got = await store.get("pools", "a")
    assert got == created

    replaced = await store.replace(
        "Pool", "a", pool("a", lb="least_request"), expect_revision=created.revision
    )
    assert replaced.revision > created.revision
    assert replaced.created_revision == created.created_revision
    assert (await store.get("Pool", "a")) == replaced

    objects, revision = await store.list("Pool")
    assert objects == [replaced] and revision >= replaced.revision

    assert await store.delete("Pool", "a", expect_revision=replaced.revision) is True
    assert await store.get("Pool", "a") is None
    assert await store.delete("Pool", "a") is False


async def test_create_existing_raises_already_exists(store: Store) -> None:
    first = await store.create("Pool", "a", pool("a"))
    with pytest.raises(AlreadyExists, match="already exists") as info:
        await store.create("Pool", "a", pool("a", other=True))
    assert isinstance(info.value, ConflictError)
    assert info.value.actual_mod_revision == first.revision
    assert (await store.get("Pool", "a")) == first


async def test_replace_with_stale_revision_raises_mismatch(store: Store) -> None:
    first = await store.create("Pool", "a", pool("a", v=1))
    second = await store.replace("Pool", "a", pool("a", v=2), expect_revision=first.revision)
    with pytest.raises(RevisionMismatch, match="fetch it again") as info:
        await store.replace("Pool", "a", pool("a", v=3), expect_revision=first.revision)
    assert info.value.actual_mod_revision == second.revision
    with pytest.raises(RevisionMismatch):
        await store.delete("Pool", "a", expect_revision=first.revision)
    got = await store.get("Pool", "a")
    assert got is not None and got.body["spec"] == pool("a", v=2)["spec"]


async def test_replace_of_deleted_object_raises_not_found(store: Store) -> None:
    first = await store.create("Pool", "a", pool("a"))
    await store.delete("Pool", "a")
    with pytest.raises(NotFound, match="create it again"):
        await store.replace("Pool", "a", pool("a"), expect_revision=first.revision)


async def test_unconditional_replace_upserts(store: Store) -> None:
    made = await store.replace("Fleet", "edge", {"spec": {}}, expect_revision=None)
    assert made.created_revision == made.revision
    again = await store.replace("Fleet", "edge", {"spec": {"x": 1}}, expect_revision=None)
    assert again.created_revision == made.revision < again.revision


async def test_exactly_one_of_two_concurrent_replaces_wins(store: Store) -> None:
    base = await store.create("RoutingPolicy", "p", {"spec": {"v": 0}})
    results = await asyncio.gather(
        *(
            store.replace("RoutingPolicy", "p", {"spec": {"v": i}}, expect_revision=base.revision)
            for i in (1, 2)
        ),
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, RevisionMismatch)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert (await store.get("RoutingPolicy", "p")) == winners[0]


async def test_garbage_value_is_reported_not_hidden(
    store: Store, client: EtcdClient, etcd_prefix: str
) -> None:
    await store.create("Pool", "good", pool("good"))
    await client.put(f"{etcd_prefix}/objects/pools/bad".encode(), b"not json")
    with pytest.raises(InvalidValue, match="replace it with PUT or remove it with DELETE"):
        await store.get("Pool", "bad")
    objects, _ = await store.list("Pool")
    assert [o.name for o in objects] == ["good"]


# -- endpoints and telemetry -----------------------------------------------------------------


async def test_endpoint_with_ttl_expires(store: Store) -> None:
    revision, lease = await store.put_endpoint(
        "gpu", "e1", {"address": "10.0.0.1", "port": 8000}, ttl=1
    )
    assert revision > 0 and lease
    await store.put_telemetry("gpu", "e1", {"queue_depth": 3}, lease=lease)
    kv = await store.client.get(store.keys.absolute(store.keys.telemetry("gpu", "e1")))
    assert kv is not None and kv.lease == lease

    async def gone() -> bool:
        endpoint = await store.client.get(store.keys.absolute(store.keys.endpoint("gpu", "e1")))
        telemetry = await store.client.get(store.keys.absolute(store.keys.telemetry("gpu", "e1")))
        return endpoint is None and telemetry is None

    await poll(gone, message="endpoint and telemetry expire with the lease")


async def test_telemetry_of_many_endpoints_is_written_in_batches_under_one_lease(
    store: Store,
) -> None:
    lease = await store.client.grant_lease(30)
    records = [("gpu", f"10.0.0.{i}:8000", {"waiting": i}) for i in range(300)]
    revision = await store.put_telemetry_many(records, lease=lease)
    written, _ = await store.client.get_prefix(store.keys.absolute("telemetry/gpu/"))
    assert len(written) == 300
    assert {kv.lease for kv in written} == {lease}
    # 128 puts to a transaction, one revision each: three transactions for 300 records.
    assert len({kv.mod_revision for kv in written}) == 3
    assert max(kv.mod_revision for kv in written) == revision


async def test_endpoint_without_ttl_stays_until_deleted(store: Store) -> None:
    _, lease = await store.put_endpoint("gpu", "e2", {"address": "10.0.0.2", "port": 8000})
    assert lease is None
    assert await store.delete_endpoint("gpu", "e2") is True
    assert await store.delete_endpoint("gpu", "e2") is False


# -- StateMirror -----------------------------------------------------------------------------


async def test_mirror_loads_then_follows_changes(store: Store, etcd_prefix: str) -> None:
    await store.create("Pool", "a", pool("a"))
    await store.put_endpoint("a", "e1", {"address": "10.0.0.1", "port": 1})
    recorder = Recorder()
    mirror = StateMirror(store.client, etcd_prefix, recorder)
    async with running(mirror):
        assert set(mirror.items) == {"objects/pools/a", "endpoints/a/e1"}
        assert recorder.changes[0].full_resync
        assert recorder.changes[0].changed == {"objects/pools/a", "endpoints/a/e1"}

        rev, _ = await store.put_endpoint("a", "e2", {"address": "10.0.0.2", "port": 1})
        await poll(lambda: mirror.revision >= rev, message="mirror sees endpoint e2")
        assert "endpoints/a/e2" in mirror.items
        change = recorder.changes[-1]
        assert change == StateChange(rev, frozenset({"endpoints/a/e2"}), full_resync=False)
        assert change.sections == {"endpoints"}

        await store.delete("Pool", "a")
        await poll(lambda: "objects/pools/a" not in mirror.items, message="delete mirrored")
        assert recorder.changes[-1].sections == {"objects"}
        assert mirror.connected and mirror.last_error is None


async def test_mirror_keeps_garbage_keys(
    store: Store, client: EtcdClient, etcd_prefix: str
) -> None:
    await client.put(f"{etcd_prefix}/objects/pools/bad".encode(), b"{not json")
    mirror = StateMirror(client, etcd_prefix)
    async with running(mirror):
        kv = mirror.items["objects/pools/bad"]
        assert decode_json(kv) is None


async def test_mirror_survives_failing_callback(store: Store, etcd_prefix: str) -> None:
    calls: list[StateChange] = []

    def flaky(change: StateChange) -> None:
        calls.append(change)
        raise RuntimeError("consumer bug")

    mirror = StateMirror(store.client, etcd_prefix, flaky)
    async with running(mirror):
        rev = await store.client.put(f"{etcd_prefix}/endpoints/p/e".encode(), b"{}")
        await poll(lambda: mirror.revision >= rev, message="mirror advances past the failure")
        assert calls[-1].changed == {"endpoints/p/e"}


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own, to kill and restart."""
    server = EmbeddedEtcd(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop()


async def test_mirror_survives_etcd_restart(private_etcd: EmbeddedEtcd) -> None:
    recorder = Recorder()
    async with EtcdClient([private_etcd.endpoint], timeout=2.0) as c:
        store = Store(c)
        await store.create("Pool", "a", pool("a"))
        mirror = StateMirror(c, "/kvpilot", recorder, backoff_max=0.5)
        async with running(mirror):
            await poll(lambda: mirror.connected, message="watch established")
            resyncs = mirror.resyncs
            before = dict(mirror.items)

            await asyncio.to_thread(private_etcd.kill)
            await poll(lambda: not mirror.connected, message="mirror notices etcd is gone")
            assert mirror.last_error
            assert dict(mirror.items) == before  # keeps serving the last state

            await asyncio.to_thread(private_etcd.start)
            rev, _ = await store.put_endpoint("a", "late", {"address": "10.0.0.9", "port": 1})
            await poll(
                lambda: "endpoints/a/late" in mirror.items,
                within=20,
                message="write after restart is mirrored",
            )
            assert mirror.connected and mirror.revision >= rev
            assert mirror.resyncs == resyncs  # resumed, not re-listed
            assert not recorder.changes[-1].full_resync


async def test_mirror_relists_after_compaction_while_disconnected(
    private_etcd: EmbeddedEtcd,
) -> None:
    recorder = Recorder()
    async with EtcdClient([private_etcd.endpoint], timeout=2.0) as c:
        store = Store(c)
        await store.create("Pool", "a", pool("a"))
        await store.create("Pool", "b", pool("b"))
        mirror = StateMirror(c, "/kvpilot", recorder, backoff_max=0.5)
        async with running(mirror):
            await poll(lambda: mirror.connected, message="watch established")
            seen = mirror.revision

            # Take the mirror's etcd away: restart etcd on another client port, write and compact
            # there, then bring it back where the mirror expects it.
            await asyncio.to_thread(private_etcd.stop)
            await poll(lambda: not mirror.connected, message="mirror notices etcd is gone")
            client_port = private_etcd.client_port
            private_etcd.client_port = free_port()
            await asyncio.to_thread(private_etcd.start)
            async with EtcdClient([private_etcd.endpoint]) as other:
                other_store = Store(other)
                await other_store.delete("Pool", "a")
                await other_store.create("Pool", "c", pool("c"))
                latest = await other.put(b"/kvpilot/objects/pools/c", b"{}")
                await other.compact(latest)
            await asyncio.to_thread(private_etcd.stop)
            private_etcd.client_port = client_port
            await asyncio.to_thread(private_etcd.start)

            await poll(
                lambda: mirror.revision >= latest and mirror.connected,
                within=20,
                message="mirror re-lists",
            )
            assert latest > seen
            assert mirror.last_error is not None and "compacted" in mirror.last_error
            assert set(mirror.items) == {"objects/pools/b", "objects/pools/c"}
            resync = recorder.changes[-1]
            assert resync.full_resync and resync.revision == latest
            assert resync.changed == {"objects/pools/a", "objects/pools/c"}


async def test_mirror_stops_when_its_client_is_closed(etcd: EmbeddedEtcd, etcd_prefix: str) -> None:
    # A closed client never works again: retrying would keep a shutting-down process (or a
    # test's teardown) waiting forever on a mirror whose cancellation a gRPC call swallowed.
    c = EtcdClient([etcd.endpoint], timeout=1.0)
    await c.connect()
    mirror = StateMirror(c, etcd_prefix, backoff_max=0.2)
    task = asyncio.create_task(mirror.run())
    await mirror.wait_synced(10)
    await c.close()
    async with asyncio.timeout(10):
        await task
    assert task.exception() is None


class Publishing(NamedTuple):
    """A publisher's loop, what makes it write, and the record that write leaves in etcd."""

    run: Coroutine[Any, Any, None]
    poke: Callable[[], object]
    key: str


def envoy_status(store: Store) -> Publishing:
    connections = ConnectionRegistry(registry=CollectorRegistry())
    publisher = StatusPublisher(store, connections, "r1", interval=0.05, settle=0.01)

    def connect() -> None:
        connections.open(node_id="envoy-1", fleet="default", peer="127.0.0.1:1", mode="sotw")

    return Publishing(publisher.run(), connect, store.keys.envoy_status("r1", "envoy-1"))


def data_plane_signals(store: Store) -> Publishing:
    book = SignalBook(lambda cluster, address, port: None)
    publisher = SignalPublisher(store, book, "r1", interval=0.05)
    return Publishing(
        publisher.run(), lambda: book.changed.add("main/all"), signals_key("r1", "main/all")
    )


@pytest.mark.parametrize("publishing", [envoy_status, data_plane_signals])
async def test_a_publisher_stops_when_its_client_is_closed(
    etcd: EmbeddedEtcd, etcd_prefix: str, publishing: Callable[[Store], Publishing]
) -> None:
    # As the mirror: a publisher that retried on a closed client would never end.
    c = EtcdClient([etcd.endpoint], timeout=1.0)
    await c.connect()
    store = Store(c, etcd_prefix)
    publisher = publishing(store)
    task = asyncio.create_task(publisher.run)
    try:

        async def published() -> bool:
            publisher.poke()  # again until the loop is listening
            return await c.get(store.keys.absolute(publisher.key)) is not None

        await poll(published, message="a first record")
        await c.close()
        publisher.poke()  # its next write meets the closed client
        async with asyncio.timeout(10):
            await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_mirror_with_dead_first_endpoint(etcd: EmbeddedEtcd, etcd_prefix: str) -> None:
    async with EtcdClient([f"127.0.0.1:{free_port()}", etcd.endpoint]) as c:
        store = Store(c, etcd_prefix)
        await store.create("Fleet", "edge", {"spec": {}})
        mirror = StateMirror(c, etcd_prefix)
        async with running(mirror):
            assert "objects/fleets/edge" in mirror.items
            rev = await c.put(f"{etcd_prefix}/endpoints/p/e".encode(), b"{}")
            await poll(lambda: mirror.revision >= rev, message="mirror follows via endpoint 2")


async def test_mirror_relists_when_etcd_history_goes_back(private_etcd: EmbeddedEtcd) -> None:
    """etcd replaced by an empty one (or restored from an old backup) at the same address."""
    recorder = Recorder()
    async with EtcdClient([private_etcd.endpoint], timeout=2.0) as c:
        store = Store(c)
        for name in "abcdef":
            await store.create("Pool", name, pool(name))
        mirror = StateMirror(c, "/kvpilot", recorder, backoff_max=0.5)
        async with running(mirror):
            await poll(lambda: mirror.connected, message="watch established")
            seen = mirror.revision
            changes_before = len(recorder.changes)

            await asyncio.to_thread(private_etcd.stop)
            await poll(lambda: not mirror.connected, message="mirror notices etcd is gone")
            shutil.rmtree(private_etcd.data_dir)
            await asyncio.to_thread(private_etcd.start)
            rev = await store.create("Pool", "z", pool("z"))
            assert rev.revision < seen

            await poll(
                lambda: set(mirror.items) == {"objects/pools/z"},
                within=20,
                message="mirror re-lists the new etcd",
            )
            # The mirror may reconnect before or after "z" is written: either it re-lists and
            # finds "z", or it re-lists the empty etcd and then sees "z" as a watch event.
            assert any(change.full_resync for change in recorder.changes[changes_before:])
            assert mirror.revision == rev.revision
