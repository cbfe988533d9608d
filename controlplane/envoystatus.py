"""Publish this replica's Envoy connections to etcd, so status shows every Envoy of every replica.

Each kvpilot replica writes one record per connected Envoy under
``{prefix}/status/envoys/{replica}/{node}``, attached to a lease the replica keeps alive. When a
replica dies its lease expires and its Envoys' records go with it; when an Envoy disconnects its
record is deleted. Writes are coalesced because "sent"/"acked" events come with every push:
the first event waits ``settle`` for the rest of its round (a fleet ACKs one push within tens of
milliseconds), the round's records go to etcd in one transaction, and the next write waits at
least ``interval``. So publishing stays out of the way of the ACKs it reports: a write per
Envoy as each ACK arrived took the event loop from the streams still answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from controlplane.etcd import EtcdClosed, EtcdError, KeyValue
from controlplane.etcd.keys import STATUS, decode_json
from controlplane.etcd.store import Store
from xdsserver.status import ConnectionRegistry, ConnectionStatus, Event

log = logging.getLogger(__name__)


def node_key(node_id: str) -> str:
    """A node id as a single etcd key segment (node ids may contain '/')."""
    return quote(node_id, safe="") or "-"


ENVOYS_PREFIX = f"{STATUS}/envoys/"
"""Relative key prefix of the Envoy status records of every replica."""


def records(items: Mapping[str, KeyValue]) -> list[dict[str, Any]]:
    """The Envoy status records among mirrored etcd `items` (relative key -> KeyValue), by key.

    What every replica published: with them a replica's status lists the Envoys of all
    replicas. A record that is not JSON is skipped (nothing kvpilot wrote).
    """
    found = []
    for key in sorted(k for k in items if k.startswith(ENVOYS_PREFIX)):
        if (body := decode_json(items[key])) is not None:
            found.append(body)
    return found


class EnvoyCounts:
    """The Envoys connected per fleet, over every replica's status records, kept from the
    mirror's changes: a record is read when it appears and forgotten when it goes, so the
    versions every push rewrites cost nothing here (an Envoy keeps its fleet for as long as
    it stays connected), and a change without Envoy records costs a prefix test per key."""

    def __init__(self) -> None:
        self._fleets: dict[str, str] = {}
        self._counts: Counter[str] = Counter()

    def update(
        self, changed: Iterable[str], items: Mapping[str, KeyValue], *, full: bool = False
    ) -> bool:
        """Take one change of the mirror (`full`: a re-list, every key); True when a fleet's
        count moved."""
        before = self.counts() if full else None
        if full:
            self._fleets, self._counts = {}, Counter()
            changed = items
        moved = False
        for key in changed:
            if not key.startswith(ENVOYS_PREFIX):
                continue
            kv = items.get(key)
            if kv is None:
                if (gone := self._fleets.pop(key, None)) is not None:
                    self._counts[gone] -= 1
                    if not self._counts[gone]:
                        del self._counts[gone]
                    moved = True
            elif key not in self._fleets:
                body = decode_json(kv)
                fleet = body.get("fleet") if isinstance(body, dict) else None
                if isinstance(fleet, str):
                    self._fleets[key] = fleet
                    self._counts[fleet] += 1
                    moved = True
        if before is not None:
            return self.counts() != before
        return moved

    def counts(self) -> dict[str, int]:
        """Fleet -> Envoys connected to any kvpilot replica."""
        return dict(self._counts)


class StatusPublisher:
    """Mirrors a ConnectionRegistry into etcd under this replica's lease."""

    def __init__(
        self,
        store: Store,
        connections: ConnectionRegistry,
        replica_id: str,
        *,
        ttl: int = 15,
        interval: float = 0.5,
        settle: float = 0.1,
    ) -> None:
        self.store = store
        self.connections = connections
        self.replica_id = replica_id
        self.ttl = ttl
        self.interval = interval
        self.settle = settle
        self._dirty: dict[str, ConnectionStatus | None] = {}
        self._wake = asyncio.Event()
        self._lease = 0

    def _on_event(self, event: Event, status: ConnectionStatus) -> None:
        key = node_key(status.node_id)
        if event == "disconnected":
            # Another stream of the same Envoy may still be open (a reconnect overlapping).
            still_open = self.connections.newest(status.node_id) is not None
            self._dirty[key] = status if still_open else None
        else:
            self._dirty[key] = status
        self._wake.set()

    def record(self, status: ConnectionStatus) -> dict[str, Any]:
        """The JSON stored for one Envoy."""
        return {**status.as_dict(), "replica": self.replica_id, "updated_at": time.time()}

    async def _republish_all(self, lease: int) -> None:
        self._lease = lease
        for status in self.connections.connections():
            self._dirty[node_key(status.node_id)] = status
        self._wake.set()

    async def run(self) -> None:
        """Publish until cancelled or until the etcd client is closed; on exit the lease is
        revoked and the records vanish (with a closed client, when the lease expires)."""
        remove = self.connections.add_listener(self._on_event)
        try:
            async with self.store.keep_lease(self.ttl, on_regrant=self._republish_all) as keeper:
                self._lease = keeper.lease_id
                while True:
                    await self._wake.wait()
                    await asyncio.sleep(self.settle)
                    self._wake.clear()
                    batch, self._dirty = self._dirty, {}
                    try:
                        await self._flush(batch)
                    except EtcdClosed:
                        log.info("etcd client closed; Envoy status is no longer published")
                        return
                    except EtcdError as error:
                        log.warning("cannot publish Envoy status to etcd (will retry): %s", error)
                        for key, status in batch.items():
                            self._dirty.setdefault(key, status)
                        self._wake.set()
                    await asyncio.sleep(self.interval)
        finally:
            remove()

    async def _flush(self, batch: dict[str, ConnectionStatus | None]) -> None:
        records = []
        for key, status in batch.items():
            # The stream may have changed since the event; publish what it is now.
            current = self.connections.newest(status.node_id) if status is not None else None
            if current is None:
                await self.store.delete_envoy_status(self.replica_id, key)
            else:
                records.append((key, self.record(current)))
        if records:
            await self.store.put_envoy_statuses(self.replica_id, records, lease=self._lease)
