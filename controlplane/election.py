"""Leader election over an etcd lease: one kvpilot replica does a job at a time.

The leader holds a key (``{prefix}/status/leaders/{job}``) attached to its lease. Every write
the leader makes is fenced: it goes in a transaction that compares the key's mod revision with
the one the leader wrote (``Leadership.fence``), so a leader that lost the key (a long pause, a
partition) cannot write after its successor has taken over.

When the leader dies, waiting for its lease alone is slower than the TTL: the lease runs out up
to a TTL after the last keep-alive, etcd looks for expired leases only every 500 ms, and its
shortest lease is 1.5 times its election timeout rounded up (2 s with etcd's defaults), so a
lease cannot simply be made shorter. So the leader also renews a heartbeat key
(``{leader key}/heartbeat``, a fenced write) every ``heartbeat_interval``, and a follower that
sees neither key change for ``silence_limit`` in its mirror, and etcd confirms the heartbeat
has not moved, deletes the leader key (only the revision it saw) and campaigns at once: a
follower takes over within ``silence_limit`` plus its poll interval after the leader's last
heartbeat, inside the TTL. The lease stays the backstop when no follower is running. A leader
that was only slow finds its fence gone on its next write and follows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

from controlplane.etcd import ConflictError, EtcdClient, EtcdError, KeyValue
from controlplane.etcd.keys import STATUS, decode_json, encode_json

log = logging.getLogger(__name__)


HEARTBEAT_SUFFIX = "/heartbeat"
"""Appended to a leader key: the key the leader renews to show it is alive."""
RECAMPAIGN_INTERVAL = 1.0
"""A follower also campaigns this often whatever its mirror shows (a lagging mirror cannot
keep it from a free key)."""


def leader_key(job: str) -> str:
    """Relative key of a job's leader record."""
    return f"{STATUS}/leaders/{job}"


def heartbeat_key(job: str) -> str:
    """Relative key of a job's leader heartbeat."""
    return leader_key(job) + HEARTBEAT_SUFFIX


@dataclass(frozen=True, slots=True)
class Leadership:
    """Proof of being the leader: the key and the revision this replica created it at."""

    key: bytes
    revision: int

    @property
    def fence(self) -> tuple[bytes, int]:
        """A comparison for ``EtcdClient.transact``: holds only while this leadership lasts."""
        return (self.key, self.revision)


class LeaderElection:
    """Campaign for a job's leader key and keep it while the lease lives."""

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        identity: str,
        *,
        ttl: int = 10,
    ) -> None:
        self.client = client
        self.key = key
        self.identity = identity
        self.ttl = ttl
        self.heartbeat_key = key + HEARTBEAT_SUFFIX.encode()
        self.leadership: Leadership | None = None
        self.lease = 0
        """The lease this replica campaigns under (kept current by its keeper)."""
        self._beat_at = -math.inf
        self._seen: tuple[int, int] | None = None
        """(leader key, heartbeat key) mod revisions the follower saw last, and when."""
        self._seen_at = 0.0
        self._campaigned_at = -math.inf

    @property
    def heartbeat_interval(self) -> float:
        """How often the leader renews its heartbeat."""
        return self.ttl / 10

    @property
    def silence_limit(self) -> float:
        """How long a follower waits without a heartbeat before it takes the key."""
        return self.ttl * 0.6

    @property
    def poll_interval(self) -> float:
        """How often a follower looks at the leader's keys (in its mirror, so cheaply)."""
        return min(0.1, self.ttl / 20)

    def _lost(self, lease: int) -> None:
        if self.leadership is not None:
            log.warning("%s: lease lost; no longer the leader", self.identity)
        self.leadership = None
        self.lease = lease

    async def campaign(self, lease: int) -> Leadership | None:
        """Try once to become the leader under ``lease``; the leadership, or None."""
        self.lease = lease
        if self.leadership is not None:
            return self.leadership
        value = encode_json({"replica": self.identity, "since": time.time()})
        try:
            revision = await self.client.put(self.key, value, lease=lease, expect_mod_revision=0)
        except ConflictError:
            return None
        self.leadership = Leadership(self.key, revision)
        self._beat_at = -math.inf
        log.info("%s: became the leader (%s)", self.identity, self.key.decode())
        return self.leadership

    async def beat(self) -> None:
        """Leader: renew the heartbeat when it is due; a failed fence ends the leadership."""
        now = time.monotonic()
        if self.leadership is None or now - self._beat_at < self.heartbeat_interval:
            return
        value = encode_json({"replica": self.identity, "at": time.time()})
        if await self.client.transact([self.leadership.fence], puts=[(self.heartbeat_key, value)]):
            self._beat_at = now
        else:
            await self.still_leader()

    async def follow(self, leader: KeyValue | None, heartbeat: KeyValue | None) -> None:
        """Follower: campaign when the key is free, or take it from a leader gone silent.

        ``leader`` and ``heartbeat`` are the two keys as this replica's mirror has them now.
        """
        now = time.monotonic()
        if leader is None or now - self._campaigned_at >= RECAMPAIGN_INTERVAL:
            self._campaigned_at = now
            if await self.campaign(self.lease) is not None or leader is None:
                self._seen = None
                return
        seen = (leader.mod_revision, heartbeat.mod_revision if heartbeat is not None else 0)
        if seen != self._seen:
            self._seen, self._seen_at = seen, now
            return
        if now - self._seen_at < self.silence_limit:
            return
        # Ask etcd itself before taking over: a mirror whose watch lags would otherwise take
        # the key from a leader that is alive.
        current = await self.client.get(self.heartbeat_key)
        beat = current.mod_revision if current is not None else 0
        if beat != seen[1]:
            self._seen, self._seen_at = (seen[0], beat), now
            return
        log.warning(
            "%s: no heartbeat from the leader for %.1fs; taking over",
            self.identity,
            now - self._seen_at,
        )
        self._seen = None
        with contextlib.suppress(ConflictError):  # it changed after all: look again
            await self.client.delete(self.key, expect_mod_revision=leader.mod_revision)
            self._campaigned_at = now
            await self.campaign(self.lease)

    async def still_leader(self) -> bool:
        """Check with etcd that the key is still ours; forget the leadership otherwise."""
        if self.leadership is None:
            return False
        kv = await self.client.get(self.key)
        if kv is None or kv.mod_revision != self.leadership.revision:
            self._lost(self.lease)
            return False
        return True

    async def resign(self) -> None:
        """Give the key up at once (a clean shutdown), so a follower need not wait a TTL."""
        if self.leadership is not None:
            with contextlib.suppress(EtcdError):  # it expires with the lease anyway
                await self.client.delete(self.key, expect_mod_revision=self.leadership.revision)
                await self.client.delete(self.heartbeat_key)
            self.leadership = None

    async def holder(self) -> str | None:
        """The replica holding the key now, if any."""
        kv = await self.client.get(self.key)
        body = decode_json(kv) if kv is not None else None
        replica = body.get("replica") if body else None
        return replica if isinstance(replica, str) else None

    def on_regrant(self, lease: int) -> None:
        """The keeper had to grant a new lease: the old key is gone, and so is leadership."""
        self._lost(lease)
