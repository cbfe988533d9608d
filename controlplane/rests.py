"""Paid pools' rests after a 429, shared across kvpilot replicas through etcd.

A provider that answered 429 with a ``Retry-After`` is out of rotation for every Envoy of the
installation, not only for those connected to the replica whose access log saw the 429. Each
replica learns rests from its own Envoys (``xdsserver.signals.ProviderRests``) and writes the
rests that began or grew, at most once per ``interval`` and in one transaction, to
``{prefix}/status/rests/{replica}/{pool}``: a batch, never a write per 429. Every replica's
overflow reads its own rests and the others' (``RestBoard``), the longest rest of each pool
winning, and rebuilds when another replica's record arrives.

A record holds the wall-clock time its rest ends, so replicas' clocks must agree (NTP) to
within what a rest may be late or early. It carries a lease that ends a second after the
rest does: etcd removes it, and a replica that stops leaves nothing that outlives its rests.
Readers also skip a record whose time has passed, so a rest ends on time even while the
lease is still running.
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
from xdsserver.signals import ProviderRests

log = logging.getLogger(__name__)

RESTS_PREFIX = f"{STATUS}/rests/"
"""Relative key prefix of every replica's rest records."""
REST_INTERVAL = 0.25
"""Least seconds between two batches of rest writes of one replica."""
LEASE_MARGIN = 1
"""Seconds a record's lease outlives its rest."""


def rest_key(replica_id: str, pool: str) -> str:
    return f"{RESTS_PREFIX}{quote(replica_id, safe='')}/{quote(pool, safe='')}"


def rest_of(key: str, kv: KeyValue | None) -> tuple[str, str, float] | None:
    """(replica, pool, until) of one record; None for a key that is not one, a deleted
    record, or a value kvpilot did not write."""
    if not key.startswith(RESTS_PREFIX) or kv is None:
        return None
    replica, _, pool = key[len(RESTS_PREFIX) :].partition("/")
    body = decode_json(kv)
    until = body.get("until") if body is not None else None
    if not pool or isinstance(until, bool) or not isinstance(until, int | float):
        return None
    if not math.isfinite(until):
        return None
    return unquote(replica), unquote(pool), float(until)


class RestBoard:
    """Every replica's rests as etcd holds them, kept from the etcd mirror's changes (no scan
    of the whole mirror per compile), merged with the rests this replica learned itself. Its
    own records count too: a replica started again under the same ``--replica-id`` keeps
    skipping a pool its previous run saw answer 429."""

    def __init__(self, local: ProviderRests, replica_id: str) -> None:
        self.local = local
        self.replica_id = replica_id
        self.remote: dict[str, tuple[str, float]] = {}
        """Record key -> (pool, until) of the rests in etcd."""
        self.listeners: list[Callable[[], None]] = []
        """Called when another replica's rest arrives (a rebuild is due; this replica's own
        rebuilt when it learned the rest)."""

    def on_change(self, change: StateChange, items: Mapping[str, KeyValue]) -> None:
        """Follow the mirror: the rest records among the changed keys (every one after a
        re-list)."""
        keys: Iterable[str] = items if change.full_resync else change.changed
        if change.full_resync:
            self.remote.clear()
        arrived = False
        for key in keys:
            if not key.startswith(RESTS_PREFIX):
                continue
            rest = rest_of(key, items.get(key))
            if rest is None:
                self.remote.pop(key, None)
                continue
            self.remote[key] = rest[1:]
            arrived = arrived or rest[0] != self.replica_id
        if arrived:
            for listener in self.listeners:
                listener()

    def active(self, now: float) -> dict[str, float]:
        """Every pool resting at `now`, by any replica: pool -> the latest end."""
        out = dict(self.local.active(now))
        for pool, until in self.remote.values():
            if until > now and until > out.get(pool, -math.inf):
                out[pool] = until
        return out


class RestPublisher:
    """Writes this replica's rests that began or grew to etcd, in batches."""

    def __init__(
        self,
        store: Store,
        rests: ProviderRests,
        replica_id: str,
        *,
        interval: float = REST_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.rests = rests
        self.replica_id = replica_id
        self.interval = interval
        self.clock = clock
        self.writes = 0
        """etcd transactions written (one per batch)."""
        self._poked = asyncio.Event()

    def poke(self) -> None:
        """A rest began or grew: write it with the next batch."""
        self._poked.set()

    async def flush(self) -> None:
        """Write every rest that began or grew since the last batch, in one transaction,
        under a lease that ends a second after the longest of them."""
        changed = self.rests.take_changed()
        now = self.clock()
        changed = {pool: until for pool, until in changed.items() if until > now}
        if not changed:
            return
        try:
            ttl = math.ceil(max(changed.values()) - now) + LEASE_MARGIN
            lease = await self.store.client.grant_lease(ttl)
            await self.store.client.put_many(
                [
                    (
                        self.store.keys.absolute(rest_key(self.replica_id, pool)),
                        encode_json(
                            {"replica": self.replica_id, "pool": pool, "at": now, "until": until}
                        ),
                    )
                    for pool, until in changed.items()
                ],
                lease=lease,
            )
            self.writes += 1
        except BaseException:
            self.rests.changed.update(changed)
            raise

    async def run(self) -> None:
        """Publish after each poke, at most once per ``interval``, until cancelled."""
        while True:
            await self._poked.wait()
            self._poked.clear()
            try:
                await self.flush()
            except EtcdClosed:
                log.info("etcd client closed; provider rests are no longer shared")
                return
            except EtcdError as error:
                log.warning("cannot share provider rests (will retry): %s", error)
                self._poked.set()
            await asyncio.sleep(self.interval)


__all__ = [
    "RESTS_PREFIX",
    "REST_INTERVAL",
    "RestBoard",
    "RestPublisher",
    "rest_key",
    "rest_of",
]
