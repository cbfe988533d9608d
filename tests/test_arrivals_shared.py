"""Fleets' arrival rates shared across kvpilot replicas: the records one replica writes to etcd,
which of its rates a batch writes, and how a reader adds the others' rates to its own
(``controlplane.arrivals``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping

import pytest
from harness.wait import poll

from controlplane.arrivals import (
    ARRIVALS_PREFIX,
    ArrivalBoard,
    ArrivalPublisher,
    arrival_key,
    arrival_of,
    changed_rates,
    sum_rates,
)
from controlplane.etcd import EtcdClient, KeyValue
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from controlplane.mirror import StateChange, StateMirror


def value(raw: bytes) -> KeyValue:
    return KeyValue(key=b"", value=raw, create_revision=1, mod_revision=1, version=1, lease=0)


def record(rate: object, replica: str = "b") -> KeyValue:
    return value(json.dumps({"replica": replica, "rate": rate}).encode())


def change(*keys: str, full: bool = False) -> StateChange:
    return StateChange(revision=1, changed=frozenset(keys), full_resync=full)


@pytest.mark.parametrize(
    ("key", "kv", "expected"),
    [
        (arrival_key("b", "east/chat"), record(4.5), ("b", "east/chat", 4.5)),
        (arrival_key("a/b", "e st/chat"), record(0), ("a/b", "e st/chat", 0.0)),
        (arrival_key("b", "east/chat"), None, None),  # deleted
        (arrival_key("b", "east/chat"), record("fast"), None),
        (arrival_key("b", "east/chat"), record(True), None),
        (arrival_key("b", "east/chat"), record(-1), None),
        (arrival_key("b", "east/chat"), value(b"[1]"), None),
        (f"{ARRIVALS_PREFIX}b/east/chat", record(1), None),  # route not one segment
        ("status/rests/b/east%2Fchat", record(1), None),
    ],
)
def test_arrival_records_that_kvpilot_did_not_write_are_skipped(
    key: str, kv: KeyValue | None, expected: tuple[str, str, float] | None
) -> None:
    assert arrival_of(key, kv) == expected


@pytest.mark.parametrize(
    ("published", "rates", "puts", "gone"),
    [
        ({}, {"e/c": 2.0}, {"e/c": 2.0}, set()),  # new
        ({"e/c": 10.0}, {"e/c": 10.4}, {}, set()),  # within 5%: not written
        ({"e/c": 10.0}, {"e/c": 10.6}, {"e/c": 10.6}, set()),
        ({"e/c": 10.0}, {"e/c": 9.4}, {"e/c": 9.4}, set()),
        ({"e/c": 10.0, "w/c": 1.0}, {"e/c": 10.0}, {}, {"w/c"}),  # no rate any more
    ],
)
def test_a_batch_writes_the_rates_that_appeared_or_moved_and_deletes_the_gone(
    published: dict[str, float], rates: dict[str, float], puts: dict[str, float], gone: set[str]
) -> None:
    assert changed_rates(published, rates) == (puts, gone)


def test_the_other_replicas_rates_add_to_the_local_ones() -> None:
    assert sum_rates({"e/c": 3.0, "w/c": 1.0}, [("e/c", 2.5), ("e/c", 0.5), ("n/c", 4.0)]) == {
        "e/c": 6.0,
        "w/c": 1.0,
        "n/c": 4.0,
    }


def test_the_board_adds_other_replicas_records_and_skips_its_own() -> None:
    local = {"e/c": 3.0}
    board = ArrivalBoard(lambda now: local, "a")
    items = {
        arrival_key("b", "e/c"): record(2.0, "b"),
        arrival_key("c", "e/c"): record(1.0, "c"),
        arrival_key("a", "e/c"): record(99.0, "a"),  # its own: from memory instead
        "objects/pools/e": record(0),
    }
    board.on_change(change(*items), items)
    assert board.rates(0.0) == {"e/c": 6.0}
    # A record removed (its lease ended) no longer counts.
    del items[arrival_key("c", "e/c")]
    board.on_change(change(arrival_key("c", "e/c")), items)
    assert board.rates(0.0) == {"e/c": 5.0}
    # After a re-list the board holds exactly what etcd holds.
    board.on_change(change(full=True), {arrival_key("d", "w/c"): record(1.5, "d")})
    assert board.rates(0.0) == {"e/c": 3.0, "w/c": 1.5}


@pytest.fixture
async def client(etcd: EmbeddedEtcd) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint]) as c:
        yield c


async def test_two_replicas_rates_sum_at_a_reader_and_a_stopped_ones_disappears(
    client: EtcdClient, etcd_prefix: str
) -> None:
    store = Store(client, etcd_prefix)
    rates_a: dict[str, float] = {"east/chat": 4.0}
    rates_b: dict[str, float] = {"east/chat": 2.5, "west/chat": 1.0}

    def publisher(rates: Mapping[str, float], replica: str) -> ArrivalPublisher:
        return ArrivalPublisher(store, lambda now: rates, replica, interval=0.1, lease_ttl=2)

    publisher_a, publisher_b = publisher(rates_a, "a"), publisher(rates_b, "b")
    reader = ArrivalBoard(lambda now: {"east/chat": 1.0}, "c")
    mirror: StateMirror

    def on_change(state_change: StateChange) -> None:
        reader.on_change(state_change, mirror.items)

    mirror = StateMirror(client, etcd_prefix, on_change)
    watching = asyncio.create_task(mirror.run())
    running_a = asyncio.create_task(publisher_a.run())
    running_b = asyncio.create_task(publisher_b.run())
    try:
        await mirror.wait_synced()
        await poll(
            lambda: reader.rates(0.0) == {"east/chat": 7.5, "west/chat": 1.0},
            within=10,
            message="both replicas' rates summed at the reader",
        )
        rates_a["east/chat"] = 6.0
        await poll(lambda: reader.rates(0.0)["east/chat"] == 9.5, within=10, message="a's new rate")
        # B stops: its lease is no longer kept alive and etcd removes its records.
        running_b.cancel()
        await asyncio.gather(running_b, return_exceptions=True)
        await poll(
            lambda: reader.rates(0.0) == {"east/chat": 7.0},
            within=15,
            message="the stopped replica's rates gone",
        )
    finally:
        for task in (running_a, running_b, watching):
            task.cancel()
        await asyncio.gather(running_a, running_b, watching, return_exceptions=True)


async def test_a_replica_that_stops_cleanly_revokes_its_lease_and_is_no_longer_counted_at_once(
    client: EtcdClient, etcd_prefix: str
) -> None:
    store = Store(client, etcd_prefix)
    # A lease far longer than the wait below: only a revoke removes the records in time.
    stopping = ArrivalPublisher(
        store, lambda now: {"east/chat": 3.0}, "s", interval=0.1, lease_ttl=60
    )
    reader = ArrivalBoard(lambda now: {}, "r")
    mirror: StateMirror

    def on_change(state_change: StateChange) -> None:
        reader.on_change(state_change, mirror.items)

    mirror = StateMirror(client, etcd_prefix, on_change)
    watching = asyncio.create_task(mirror.run())
    running = asyncio.create_task(stopping.run())
    try:
        await mirror.wait_synced()
        await poll(lambda: reader.rates(0.0) == {"east/chat": 3.0}, within=10, message="counted")
        lease = stopping.lease
        assert lease and await client.lease_time_to_live(lease) > 0
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        assert await client.lease_time_to_live(lease) == 0  # revoked, not left to expire
        await poll(lambda: reader.rates(0.0) == {}, within=3, message="no longer counted")
        records, _ = await client.get_prefix(store.keys.absolute(ARRIVALS_PREFIX))
        assert not records
    finally:
        for task in (running, watching):
            task.cancel()
        await asyncio.gather(running, watching, return_exceptions=True)
