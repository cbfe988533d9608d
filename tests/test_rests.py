"""Paid pools' rests shared across kvpilot replicas: what one replica writes to etcd after a
429, and how every replica merges the others' rests with its own (``controlplane.rests``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from controlplane.etcd import EtcdClient, KeyValue
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from controlplane.mirror import StateChange, StateMirror
from controlplane.rests import RESTS_PREFIX, RestBoard, RestPublisher, rest_key, rest_of
from xdsserver.signals import ProviderRests

NOW = 1_800_000_000.0


def value(raw: bytes) -> KeyValue:
    return KeyValue(key=b"", value=raw, create_revision=1, mod_revision=1, version=1, lease=0)


def record(until: object, replica: str = "b") -> KeyValue:
    return value(json.dumps({"replica": replica, "until": until}).encode())


def change(*keys: str, full: bool = False) -> StateChange:
    return StateChange(revision=1, changed=frozenset(keys), full_resync=full)


def test_a_rest_that_began_or_grew_is_taken_once() -> None:
    clock = [NOW]
    rests = ProviderRests(clock=lambda: clock[0])
    rests.observe("cheap", "10")
    rests.observe("cheap", "3")  # shorter: not a change
    assert rests.take_changed() == {"cheap": NOW + 10}
    assert rests.take_changed() == {}
    rests.observe("cheap", "20")
    assert rests.take_changed() == {"cheap": NOW + 20}


@pytest.mark.parametrize(
    ("key", "kv", "expected"),
    [
        (rest_key("b", "cheap"), record(NOW + 5), ("b", "cheap", NOW + 5)),
        (rest_key("a/b", "p q"), record(NOW), ("a/b", "p q", NOW)),
        (rest_key("b", "cheap"), None, None),  # deleted
        (rest_key("b", "cheap"), record("soon"), None),
        (rest_key("b", "cheap"), record(True), None),
        (rest_key("b", "cheap"), value(b"[1]"), None),
        ("status/spend/b/acme", record(NOW), None),
    ],
)
def test_rest_records_that_kvpilot_did_not_write_are_skipped(
    key: str, kv: KeyValue | None, expected: tuple[str, str, float] | None
) -> None:
    assert rest_of(key, kv) == expected


def test_every_replicas_rests_merge_the_longest_winning() -> None:
    local = ProviderRests(clock=lambda: NOW)
    board = RestBoard(local, "a")
    calls: list[None] = []
    board.listeners.append(lambda: calls.append(None))
    items = {
        rest_key("b", "cheap"): record(NOW + 8, "b"),
        rest_key("c", "cheap"): record(NOW + 3, "c"),
        rest_key("c", "dear"): record(NOW - 1, "c"),  # over: skipped on reading
        rest_key("a", "tidy"): record(NOW + 50, "a"),  # its own, from before a restart
        "objects/pools/cheap": record(0),
    }
    board.on_change(change(*items), items)
    assert len(calls) == 1
    local.observe("cheap", "4")
    assert board.active(NOW) == {"cheap": NOW + 8, "tidy": NOW + 50}
    local.observe("cheap", "12")
    assert board.active(NOW)["cheap"] == NOW + 12
    # Its own record arriving (written after it learned the rest) rebuilds nothing more.
    board.on_change(change(rest_key("a", "tidy")), items)
    assert len(calls) == 1

    # A record removed (its lease ended) no longer counts, and calls nobody.
    del items[rest_key("b", "cheap")]
    board.on_change(change(rest_key("b", "cheap")), items)
    assert board.active(NOW + 5)["cheap"] == NOW + 12 and len(calls) == 1
    # After a re-list the board holds exactly what etcd holds.
    board.on_change(change(full=True), {rest_key("d", "dear"): record(NOW + 2, "d")})
    assert board.remote == {rest_key("d", "dear"): ("dear", NOW + 2)} and len(calls) == 2
    assert board.active(NOW + 1) == {"cheap": NOW + 12, "dear": NOW + 2}
    assert board.active(NOW + 12) == {}


@pytest.fixture
async def client(etcd: EmbeddedEtcd) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint]) as c:
        yield c


async def test_a_rest_reaches_another_replica_through_etcd_and_its_record_expires(
    client: EtcdClient, etcd_prefix: str
) -> None:
    store = Store(client, etcd_prefix)
    learned = ProviderRests()
    publisher = RestPublisher(store, learned, "a")
    other = RestBoard(ProviderRests(), "b")
    arrived, gone = asyncio.Event(), asyncio.Event()
    other.listeners.append(arrived.set)
    mirror: StateMirror

    def on_change(state_change: StateChange) -> None:
        other.on_change(state_change, mirror.items)
        if arrived.is_set() and not any(key.startswith(RESTS_PREFIX) for key in mirror.items):
            gone.set()

    mirror = StateMirror(client, etcd_prefix, on_change)
    watching = asyncio.create_task(mirror.run())
    try:
        await mirror.wait_synced()
        learned.observe("cheap", "2")
        learned.observe("dear", "1")
        await publisher.flush()
        await publisher.flush()  # nothing new: nothing written
        assert publisher.writes == 1
        async with asyncio.timeout(10):
            await arrived.wait()

        resting = other.active(time.time())
        assert set(resting) == {"cheap", "dear"}
        assert resting["cheap"] == pytest.approx(learned.until["cheap"])
        # The lease ends a second after the longest rest: etcd removes the records.
        async with asyncio.timeout(15):
            await gone.wait()
        assert other.remote == {}
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
