"""Leader election over an etcd lease: one kvpilot replica does a job at a time.

The leader holds a key (``{prefix}/status/leaders/{job}``) attached to its lease. When it dies
the lease expires within its TTL, etcd deletes the key, and the next replica that polls creates
it. Every write the leader makes is fenced: it goes in a transaction that compares the key's
mod revision with the one the leader wrote (``Leadership.fence``), so a leader that lost its
lease (a long pause, a partition) cannot write after its successor has taken over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from controlplane.etcd import ConflictError, EtcdClient, EtcdError
from controlplane.store import STATUS, decode_json, encode_json

log = logging.getLogger(__name__)


def leader_key(job: str) -> str:
    """Relative key of a job's leader record."""
    return f"{STATUS}/leaders/{job}"


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
        self.leadership: Leadership | None = None
        self._lease = 0

    @property
    def poll_interval(self) -> float:
        """How often a follower tries to take over (a fraction of the TTL)."""
        return min(1.0, self.ttl / 8)

    def _lost(self, lease: int) -> None:
        if self.leadership is not None:
            log.warning("%s: lease lost; no longer the leader", self.identity)
        self.leadership = None
        self._lease = lease

    async def campaign(self, lease: int) -> Leadership | None:
        """Try once to become the leader under ``lease``; the leadership, or None."""
        self._lease = lease
        if self.leadership is not None:
            return self.leadership
        value = encode_json({"replica": self.identity, "since": time.time()})
        try:
            revision = await self.client.put(self.key, value, lease=lease, expect_mod_revision=0)
        except ConflictError:
            return None
        self.leadership = Leadership(self.key, revision)
        log.info("%s: became the leader (%s)", self.identity, self.key.decode())
        return self.leadership

    async def still_leader(self) -> bool:
        """Check with etcd that the key is still ours; forget the leadership otherwise."""
        if self.leadership is None:
            return False
        kv = await self.client.get(self.key)
        if kv is None or kv.mod_revision != self.leadership.revision:
            self._lost(self._lease)
            return False
        return True

    async def resign(self) -> None:
        """Give the key up at once (a clean shutdown), so a follower need not wait a TTL."""
        if self.leadership is not None:
            with contextlib.suppress(EtcdError):  # it expires with the lease anyway
                await self.client.delete(self.key, expect_mod_revision=self.leadership.revision)
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

    async def sleep(self) -> None:
        await asyncio.sleep(self.poll_interval)
