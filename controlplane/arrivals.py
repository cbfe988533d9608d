"""Fleets' arrival rates shared across kvpilot replicas through etcd.

Each replica counts the request starts its own Envoys report (``xdsserver.arrivals``). A
fleet whose Envoys are spread over several replicas is seen in part by each, and spill's
feed-forward (``signals.spill``: keep = trim x 0.97 x capacity / arrivals) would then keep too
much local. So each replica writes its per-(fleet, route cluster) rates to
``{prefix}/status/arrivals/{replica}/{fleet/cluster}``, in one transaction per batch, at most
once per ``ARRIVAL_INTERVAL`` and only the rates that moved by more than ``ARRIVAL_CHANGE``
(a batch, never a write per request), and every replica adds the other replicas' records to
its own rates, which it reads from memory (``ArrivalBoard``).

The records carry one lease per replica, kept alive while the replica publishes: a replica
that stops cleanly revokes it on the way out, and its records go at once; one that dies (or
loses etcd) stops counting ``ARRIVAL_LEASE`` seconds later at most. A rate
that is unchanged is not written again; its record stays while the lease lives. A shared
rate lags the other replicas' counts by the interval plus the watch, about a second: spill
follows a change of a fleet's demand that much later than its own Envoys' part.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import quote, unquote

from controlplane.etcd import EtcdClosed, EtcdError, KeyValue
from controlplane.etcd.keys import STATUS, decode_json, encode_json
from controlplane.etcd.store import Store
from controlplane.mirror import StateChange

log = logging.getLogger(__name__)

ARRIVALS_PREFIX = f"{STATUS}/arrivals/"
"""Relative key prefix of every replica's arrival-rate records."""
ARRIVAL_INTERVAL = 0.5
"""Least seconds between two batches of one replica's rate writes."""
ARRIVAL_CHANGE = 0.05
"""A rate is written again when it moved by more than this share of the one last written:
the rate's own noise over its window is about 8% at 10 requests a second."""
ARRIVAL_LEASE = 5
"""Seconds a replica's records outlive its last keepalive."""

REVOKE_TIMEOUT = 2.0
"""Seconds a stopping replica waits for etcd to revoke its lease."""

Rates = Callable[[float], Mapping[str, float]]
"""``now`` -> ``fleet/cluster`` -> requests started per second."""


def arrival_key(replica_id: str, route: str) -> str:
    """The record of `replica_id`'s rate for `route` (``fleet/cluster``, one key segment)."""
    return f"{ARRIVALS_PREFIX}{quote(replica_id, safe='')}/{quote(route, safe='')}"


def arrival_of(key: str, kv: KeyValue | None) -> tuple[str, str, float] | None:
    """(replica, ``fleet/cluster``, rate) of one record; None for a key that is not one, a
    deleted record, or a value kvpilot did not write."""
    if not key.startswith(ARRIVALS_PREFIX) or kv is None:
        return None
    replica, _, route = key[len(ARRIVALS_PREFIX) :].partition("/")
    body = decode_json(kv)
    rate = body.get("rate") if body is not None else None
    if not replica or not route or "/" in route:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        return None
    if not math.isfinite(rate) or rate < 0:
        return None
    return unquote(replica), unquote(route), float(rate)


def changed_rates(
    published: Mapping[str, float],
    rates: Mapping[str, float],
    change: float = ARRIVAL_CHANGE,
) -> tuple[dict[str, float], set[str]]:
    """What a batch writes: the rates new or moved by more than `change` of the published one,
    and the routes published that no longer have a rate (their records are deleted)."""
    puts = {
        route: rate
        for route, rate in rates.items()
        if route not in published or abs(rate - published[route]) > change * published[route]
    }
    return puts, set(published) - set(rates)


def sum_rates(local: Mapping[str, float], remote: Iterable[tuple[str, float]]) -> dict[str, float]:
    """This replica's rates plus the other replicas' (route, rate) records."""
    out = dict(local)
    for route, rate in remote:
        out[route] = round(out.get(route, 0.0) + rate, 4)
    return out


class ArrivalBoard:
    """The other replicas' rates as etcd holds them, kept from the etcd mirror's changes, and
    added to this replica's own (read from memory, never from its records in etcd, which lag
    and are written only when they move)."""

    def __init__(self, local: Rates, replica_id: str) -> None:
        self.local = local
        self.replica_id = replica_id
        self.remote: dict[str, tuple[str, float]] = {}
        """Record key -> (``fleet/cluster``, rate) of the other replicas' records."""

    def on_change(self, change: StateChange, items: Mapping[str, KeyValue]) -> None:
        """Follow the mirror: the arrival records among the changed keys (every one after a
        re-list)."""
        keys: Iterable[str] = items if change.full_resync else change.changed
        if change.full_resync:
            self.remote.clear()
        for key in keys:
            if not key.startswith(ARRIVALS_PREFIX):
                continue
            record = arrival_of(key, items.get(key))
            if record is None or record[0] == self.replica_id:
                self.remote.pop(key, None)
                continue
            self.remote[key] = record[1:]

    def rates(self, now: float) -> dict[str, float]:
        """``fleet/cluster`` -> requests started per second by the fleet's Envoys of every
        replica."""
        return sum_rates(self.local(now), self.remote.values())


class ArrivalPublisher:
    """Writes this replica's arrival rates that moved to etcd, in batches, under a lease it
    keeps alive."""

    def __init__(
        self,
        store: Store,
        rates: Rates,
        replica_id: str,
        *,
        interval: float = ARRIVAL_INTERVAL,
        lease_ttl: int = ARRIVAL_LEASE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.rates = rates
        self.replica_id = replica_id
        self.interval = interval
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.published: dict[str, float] = {}
        """``fleet/cluster`` -> the rate last written."""
        self.lease = 0
        self.writes = 0
        """etcd transactions written (one per batch that had a change)."""
        self._kept = -math.inf

    async def _keep_lease(self) -> None:
        """Refresh the lease a third of its TTL after the last refresh; after it was lost
        (etcd unreachable longer than the TTL), start again with a new one and every rate."""
        now = time.monotonic()
        if self.lease and now - self._kept >= self.lease_ttl / 3:
            if await self.store.client.keepalive_once(self.lease) == 0:
                self.lease = 0
            self._kept = now
        if not self.lease:
            self.published.clear()
            self.lease = await self.store.client.grant_lease(self.lease_ttl)
            self._kept = now

    async def flush(self) -> None:
        """Write the rates that moved or appeared, in one transaction, and delete the records
        of routes that no longer have a rate."""
        now = self.clock()
        rates = self.rates(now)
        if not rates and not self.published and not self.lease:
            return
        await self._keep_lease()
        puts, gone = changed_rates(self.published, rates)
        if puts:
            await self.store.client.put_many(
                [
                    (
                        self.store.keys.absolute(arrival_key(self.replica_id, route)),
                        encode_json(
                            {"replica": self.replica_id, "route": route, "at": now, "rate": rate}
                        ),
                    )
                    for route, rate in puts.items()
                ],
                lease=self.lease,
            )
            self.published.update(puts)
        for route in gone:
            await self.store.client.delete(
                self.store.keys.absolute(arrival_key(self.replica_id, route))
            )
            del self.published[route]
        if puts or gone:
            self.writes += 1

    async def run(self) -> None:
        """Publish every ``interval`` until cancelled; on the way out the lease is revoked,
        so the other replicas stop counting this one's rates at once rather than when the
        lease expires."""
        try:
            while True:
                try:
                    await self.flush()
                except EtcdClosed:
                    log.info("etcd client closed; arrival rates are no longer shared")
                    return
                except EtcdError as error:
                    log.warning("cannot share arrival rates (will retry): %s", error)
                await asyncio.sleep(self.interval)
        finally:
            await self.revoke()

    async def revoke(self) -> None:
        """Revoke the lease (its records go with it); etcd unreachable: they expire."""
        lease, self.lease = self.lease, 0
        self.published.clear()
        if not lease:
            return
        try:
            async with asyncio.timeout(REVOKE_TIMEOUT):
                await self.store.client.revoke_lease(lease)
        except (EtcdError, TimeoutError) as error:
            log.info("arrival rates' lease not revoked (it expires instead): %s", error)


__all__ = [
    "ARRIVALS_PREFIX",
    "ARRIVAL_CHANGE",
    "ARRIVAL_INTERVAL",
    "ARRIVAL_LEASE",
    "REVOKE_TIMEOUT",
    "ArrivalBoard",
    "ArrivalPublisher",
    "arrival_key",
    "arrival_of",
    "changed_rates",
    "sum_rates",
]
