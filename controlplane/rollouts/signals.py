"""Data-plane signals shared across kvpilot replicas through etcd.

Each replica receives the access logs of the Envoys connected to it (``xdsserver.signals``)
and keeps cumulative per-pool counters. This module publishes them under
``{prefix}/status/signals/{replica}/{cluster}``, attached to the replica's lease, at most once
per ``interval`` and only for clusters that saw traffic. The replica that drives rollouts reads
every replica's records from its etcd mirror and sums them (``collect``): that is the whole
fleet's view, whichever replica each Envoy happens to talk to.

Counters are cumulative since the replica started, so a step's numbers are "now minus the
step's start", replica by replica; a replica that appears later starts from zero, and one whose
lease expired takes its counts with it (the controller keeps the last seen numbers of each
step in its own record, so a verdict does not go backwards).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any
from urllib.parse import quote, unquote

from compiler import RoutingPlan
from compiler.rollout import PoolSignals, merge
from controlplane.etcd import EtcdClosed, EtcdError, KeyValue
from controlplane.etcd.keys import STATUS, decode_json, encode_json
from controlplane.etcd.store import Store
from xdsserver.arrivals import route_cluster
from xdsserver.signals import SignalBook

log = logging.getLogger(__name__)

SIGNALS_PREFIX = f"{STATUS}/signals/"
"""Relative key prefix of every replica's signal records."""


class PlanResolver:
    """Maps an upstream host of a route's clusters to its pool, from the current plan."""

    def __init__(self, plan: Callable[[], RoutingPlan | None]) -> None:
        self._plan = plan
        self._seen: RoutingPlan | None = None
        self._index: dict[str, dict[tuple[str, int], str]] = {}

    def __call__(self, cluster: str, address: str, port: int) -> str | None:
        plan = self._plan()
        if plan is not self._seen:
            self._index = {}
            for fleet in plan.fleets if plan is not None else ():
                for plan_cluster in fleet.clusters:
                    hosts = self._index.setdefault(route_cluster(plan_cluster.name), {})
                    for endpoint in plan_cluster.endpoints:
                        hosts[(endpoint.address, endpoint.port)] = endpoint.pool
            self._seen = plan
        return self._index.get(route_cluster(cluster), {}).get((address, port))


def signals_key(replica_id: str, cluster: str) -> str:
    return f"{SIGNALS_PREFIX}{quote(replica_id, safe='')}/{quote(cluster, safe='')}"


def collect(
    items: Mapping[str, KeyValue], cluster: str, fleets: Collection[str] | None = None
) -> dict[str, dict[str, PoolSignals]]:
    """Every replica's counters for one route cluster: replica -> pool -> signals.

    ``fleets``: only what the Envoys of these fleets logged (None: every fleet). Records that
    do not parse are skipped (nothing kvpilot wrote).
    """
    out: dict[str, dict[str, PoolSignals]] = {}
    suffix = "/" + quote(cluster, safe="")
    for key, kv in items.items():
        if not key.startswith(SIGNALS_PREFIX) or not key.endswith(suffix):
            continue
        body = decode_json(kv)
        if body is None or not isinstance(body.get("pools"), dict):
            continue
        replica = unquote(key[len(SIGNALS_PREFIX) :].split("/", 1)[0])
        try:
            if fleets is None:
                out[replica] = {
                    pool: PoolSignals.from_json(value) for pool, value in body["pools"].items()
                }
                continue
            by_fleet = body.get("fleets")
            by_fleet = by_fleet if isinstance(by_fleet, dict) else {}
            out[replica] = merge(
                {pool: PoolSignals.from_json(value) for pool, value in dict(pools).items()}
                for fleet, pools in by_fleet.items()
                if fleet in fleets
            )
        except (ValueError, TypeError):
            continue
    return out


class SignalPublisher:
    """Writes a SignalBook's changed clusters to etcd under this replica's lease."""

    def __init__(
        self,
        store: Store,
        book: SignalBook,
        replica_id: str,
        *,
        ttl: int = 15,
        interval: float = 0.5,
    ) -> None:
        self.store = store
        self.book = book
        self.replica_id = replica_id
        self.ttl = ttl
        self.interval = interval
        self._lease = 0

    def record(self, cluster: str) -> dict[str, Any]:
        """The JSON stored for one cluster."""
        return {
            "replica": self.replica_id,
            "cluster": cluster,
            "at": time.time(),
            "pools": {
                pool: signals.as_json()
                for pool, signals in sorted(self.book.counters.get(cluster, {}).items())
            },
            "fleets": {
                fleet: {pool: signals.as_json() for pool, signals in sorted(pools.items())}
                for fleet, pools in sorted(self.book.by_fleet.get(cluster, {}).items())
            },
        }

    async def _republish_all(self, lease: int) -> None:
        self._lease = lease
        self.book.changed.update(self.book.counters)

    async def run(self) -> None:
        """Publish until cancelled or until the etcd client is closed; on exit the lease is
        revoked and the records vanish (with a closed client, when the lease expires)."""
        async with self.store.client.keepalive_forever(
            self.ttl, on_regrant=self._republish_all
        ) as keeper:
            self._lease = keeper.lease_id
            while True:
                await asyncio.sleep(self.interval)
                changed = self.book.take_changed()
                try:
                    for cluster in sorted(changed):
                        await self.store.client.put(
                            self.store.keys.absolute(signals_key(self.replica_id, cluster)),
                            encode_json(self.record(cluster)),
                            lease=self._lease,
                        )
                except EtcdClosed:
                    log.info("etcd client closed; data-plane signals are no longer published")
                    return
                except EtcdError as error:
                    log.warning("cannot publish data-plane signals (will retry): %s", error)
                    self.book.changed.update(changed)
