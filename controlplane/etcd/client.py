"""A thin, typed asyncio client for the etcd v3 API.

Built directly on aetcd's generated gRPC stubs over ``grpc.aio`` channels, because the
daemon needs what aetcd's high-level client hides: response header revisions, a watch that
reports compaction and broken streams as typed errors (so the caller can resume or re-list),
and explicit control over reconnects. KV and lease calls live here, the watch in
``controlplane.etcd.watch``.

The channels, retries and failover beneath every call, and how each failure surfaces, are
``controlplane.etcd.connection``'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from aetcd import rpc

from controlplane.etcd.connection import Conn, raise_for_status
from controlplane.etcd.lease import LeaseKeeper
from controlplane.etcd.types import (
    CompactedError,
    ConflictError,
    EtcdError,
    EtcdStatus,
    KeyValue,
    LeaseNotFoundError,
    prefix_range_end,
)
from controlplane.etcd.watch import EtcdWatch

log = logging.getLogger(__name__)


_RANGE_PAGE_SIZE = 1000

MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: the most operations one transaction may hold."""


class EtcdClient(EtcdWatch):
    """An etcd v3 client. Use as ``async with EtcdClient(["127.0.0.1:2379"]) as client``.

    Several endpoints may be given; calls go to one at a time and move to the next when the
    current one is unreachable.
    """

    async def check_access(self) -> None:
        """Ask etcd for its status: raises ``EtcdAccessDenied`` when etcd refuses our TLS
        certificate or credentials (worth stopping for at start), ``EtcdUnavailable`` when
        it cannot be reached (worth waiting for)."""
        await self.status()

    # -- KV ---------------------------------------------------------------------------------

    async def get(self, key: bytes, *, revision: int = 0) -> KeyValue | None:
        """The key's value now, or as it was at ``revision`` (``CompactedError`` if etcd has
        compacted that far)."""
        request = rpc.RangeRequest(key=key, revision=revision)
        response = await self._call(
            lambda c, t: c.kv.Range(request, timeout=t), what=f"get {key!r}"
        )
        return KeyValue.from_pb(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, sorted by key, and the revision they were read at.

        Large ranges are read in pages, all at the revision of the first page, so the result is
        one consistent snapshot. If that revision is compacted mid-way, the read starts over.
        """
        range_end = prefix_range_end(prefix)
        for _ in range(5):
            kvs: list[KeyValue] = []
            revision = 0
            key = prefix
            try:
                while True:
                    request = rpc.RangeRequest(
                        key=key, range_end=range_end, limit=_RANGE_PAGE_SIZE, revision=revision
                    )
                    response = await self._call(
                        functools.partial(_range, request), what=f"list {prefix!r}"
                    )
                    if revision == 0:
                        revision = response.header.revision
                    kvs.extend(KeyValue.from_pb(kv) for kv in response.kvs)
                    if not response.more or not response.kvs:
                        return kvs, revision
                    key = response.kvs[-1].key + b"\x00"
            except CompactedError:
                log.info("revision %d compacted while listing %r; starting over", revision, prefix)
        raise EtcdError(f"could not list {prefix!r}: etcd kept compacting under the read")

    async def put(
        self,
        key: bytes,
        value: bytes,
        *,
        lease: int = 0,
        expect_mod_revision: int | None = None,
    ) -> int:
        """Write ``key``; returns the new revision.

        ``expect_mod_revision``: ``None`` writes unconditionally, ``0`` creates (the key must not
        exist), ``N`` replaces only if the key's ``mod_revision`` is ``N``. Otherwise raises
        ``ConflictError``.
        """
        kv = await self.put_kv(key, value, lease=lease, expect_mod_revision=expect_mod_revision)
        return kv.mod_revision

    async def put_kv(
        self,
        key: bytes,
        value: bytes,
        *,
        lease: int = 0,
        expect_mod_revision: int | None = None,
    ) -> KeyValue:
        """Like ``put``, but returns the written ``KeyValue`` (its create revision and version
        come from the same atomic write, not from a second read)."""
        kv, _ = await self.put_with_previous(
            key, value, lease=lease, expect_mod_revision=expect_mod_revision
        )
        return kv

    async def put_with_previous(
        self,
        key: bytes,
        value: bytes,
        *,
        lease: int = 0,
        expect_mod_revision: int | None = None,
    ) -> tuple[KeyValue, KeyValue | None]:
        """Like ``put_kv``, plus the value the write replaced (None if the key was new), read
        by etcd in the same write: what an audit record needs."""
        put = rpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)
        if expect_mod_revision is None:
            response = await self._call(
                lambda c, t: c.kv.Put(put, timeout=t), what=f"put {key!r}", write=True
            )
            put_response = response
        else:
            response = await self._compare_and(
                key, expect_mod_revision, rpc.RequestOp(request_put=put), what="put"
            )
            put_response = response.responses[0].response_put
        revision = int(response.header.revision)
        prev = put_response.prev_kv if put_response.HasField("prev_kv") else None
        written = KeyValue(
            key=key,
            value=value,
            create_revision=int(prev.create_revision) if prev is not None else revision,
            mod_revision=revision,
            version=int(prev.version) + 1 if prev is not None else 1,
            lease=lease,
        )
        return written, KeyValue.from_pb(prev) if prev is not None else None

    async def put_many(self, items: Sequence[tuple[bytes, bytes]], *, lease: int = 0) -> int:
        """Write every (key, value) unconditionally, ``MAX_TXN_OPS`` to a transaction; returns
        the last revision. One revision and one round trip per transaction instead of per key:
        what lets many agents' telemetry reach etcd at a rate etcd and the watchers keep up
        with. Idempotent, so retried like a plain put."""
        revision = 0
        for start in range(0, len(items), MAX_TXN_OPS):
            chunk = items[start : start + MAX_TXN_OPS]
            txn = rpc.TxnRequest(
                success=[
                    rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))
                    for key, value in chunk
                ]
            )
            revision = await self._put_txn(txn, len(chunk))
        return revision

    async def _put_txn(self, txn: Any, count: int) -> int:
        response = await self._call(
            lambda c, t: c.kv.Txn(txn, timeout=t), what=f"put of {count} keys"
        )
        return int(response.header.revision)

    async def delete(self, key: bytes, *, expect_mod_revision: int | None = None) -> bool:
        """Delete ``key``; True if it existed. With ``expect_mod_revision``, ``ConflictError``
        unless the key's ``mod_revision`` matches."""
        deleted, _ = await self.delete_with_previous(key, expect_mod_revision=expect_mod_revision)
        return deleted is not None

    async def delete_with_previous(
        self, key: bytes, *, expect_mod_revision: int | None = None
    ) -> tuple[KeyValue | None, int]:
        """Like ``delete``; returns the deleted value (None if there was none) and the revision
        of the delete."""
        delete = rpc.DeleteRangeRequest(key=key, prev_kv=True)
        if expect_mod_revision is None:
            response = await self._call(
                lambda c, t: c.kv.DeleteRange(delete, timeout=t), what=f"delete {key!r}", write=True
            )
            deleted = response
        else:
            response = await self._compare_and(
                key, expect_mod_revision, rpc.RequestOp(request_delete_range=delete), what="delete"
            )
            deleted = response.responses[0].response_delete_range
        previous = KeyValue.from_pb(deleted.prev_kvs[0]) if deleted.prev_kvs else None
        return previous, int(response.header.revision)

    async def _compare_and(
        self, key: bytes, expect_mod_revision: int, operation: Any, *, what: str
    ) -> Any:
        """Run ``operation`` only if ``key``'s mod_revision is ``expect_mod_revision`` (0: the
        key must not exist); otherwise raise ``ConflictError`` with the actual revision, read in
        the same transaction. Not retried once sent: it may have been applied."""
        txn = rpc.TxnRequest(
            compare=[_mod_revision_equals(key, expect_mod_revision)],
            success=[operation],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))],
        )
        response = await self._call(
            lambda c, t: c.kv.Txn(txn, timeout=t),
            what=f"{what} {key!r}",
            idempotent=False,
            write=True,
        )
        if not response.succeeded:
            raise ConflictError(key, _txn_actual_revision(response), expect_mod_revision)
        return response

    async def transact(
        self,
        compares: Sequence[tuple[bytes, int]],
        *,
        puts: Sequence[tuple[bytes, bytes]] = (),
        deletes: Sequence[bytes] = (),
    ) -> int | None:
        """Write ``puts`` and delete ``deletes`` atomically, only if every ``(key,
        mod_revision)`` of ``compares`` holds (0: the key must not exist). Returns the new
        revision, or None when a comparison failed and nothing was written. Not retried once
        sent: it may have been applied."""
        txn = rpc.TxnRequest(
            compare=[_mod_revision_equals(key, revision) for key, revision in compares],
            success=[
                *(rpc.RequestOp(request_put=rpc.PutRequest(key=k, value=v)) for k, v in puts),
                *(
                    rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k))
                    for k in deletes
                ),
            ],
        )
        response = await self._call(
            lambda c, t: c.kv.Txn(txn, timeout=t), what="transaction", idempotent=False
        )
        return int(response.header.revision) if response.succeeded else None

    async def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        request = rpc.DeleteRangeRequest(key=prefix, range_end=prefix_range_end(prefix))
        response = await self._call(
            lambda c, t: c.kv.DeleteRange(request, timeout=t),
            what=f"delete prefix {prefix!r}",
            write=True,
        )
        return int(response.deleted)

    async def count_prefix(self, prefix: bytes) -> int:
        """How many keys are under ``prefix`` (etcd counts; nothing is transferred)."""
        request = rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix), count_only=True)
        response = await self._call(
            lambda c, t: c.kv.Range(request, timeout=t), what=f"count {prefix!r}"
        )
        return int(response.count)

    async def first_keys(self, prefix: bytes, limit: int) -> list[bytes]:
        """The ``limit`` smallest keys under ``prefix``, without their values."""
        request = rpc.RangeRequest(
            key=prefix, range_end=prefix_range_end(prefix), keys_only=True, limit=limit
        )
        response = await self._call(
            lambda c, t: c.kv.Range(request, timeout=t), what=f"list keys {prefix!r}"
        )
        return [kv.key for kv in response.kvs]

    async def last_values(self, prefix: bytes, limit: int) -> list[KeyValue]:
        """The ``limit`` largest keys under ``prefix`` with their values, largest first."""
        request = rpc.RangeRequest(
            key=prefix,
            range_end=prefix_range_end(prefix),
            limit=limit,
            sort_order=rpc.RangeRequest.DESCEND,
            sort_target=rpc.RangeRequest.KEY,
        )
        response = await self._call(
            lambda c, t: c.kv.Range(request, timeout=t), what=f"list {prefix!r}"
        )
        return [KeyValue.from_pb(kv) for kv in response.kvs]

    async def delete_range(self, start: bytes, end: bytes) -> int:
        """Delete every key in ``[start, end)``; returns how many were deleted."""
        request = rpc.DeleteRangeRequest(key=start, range_end=end)
        response = await self._call(
            lambda c, t: c.kv.DeleteRange(request, timeout=t), what=f"delete {start!r}..{end!r}"
        )
        return int(response.deleted)

    async def compact(self, revision: int) -> None:
        """Compact history up to ``revision`` (physically, so watches see it at once)."""
        request = rpc.CompactionRequest(revision=revision, physical=True)
        await self._call(lambda c, t: c.kv.Compact(request, timeout=t), what="compact")

    async def status(self) -> EtcdStatus:
        """Status of the member this client currently talks to."""
        response = await self._call(
            lambda c, t: c.maintenance.Status(rpc.StatusRequest(), timeout=t), what="status"
        )
        return EtcdStatus(
            endpoint=self.current_endpoint,
            version=response.version,
            revision=response.header.revision,
            member_id=response.header.member_id,
            leader=response.leader,
            raft_term=response.raftTerm,
            db_size=response.dbSize,
        )

    # -- leases -----------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds; returns its id."""
        request = rpc.LeaseGrantRequest(TTL=ttl)
        response = await self._call(
            lambda c, t: c.lease.LeaseGrant(request, timeout=t), what="grant lease"
        )
        if response.error:
            raise EtcdError(f"etcd refused to grant a {ttl}s lease: {response.error}")
        return int(response.ID)

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys. A lease that is already gone is not an error."""
        request = rpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(LeaseNotFoundError):
            await self._call(
                lambda c, t: c.lease.LeaseRevoke(request, timeout=t), what="revoke lease"
            )

    async def lease_time_to_live(self, lease_id: int) -> int:
        """Seconds left on a lease without refreshing it; 0 if the lease is gone."""
        request = rpc.LeaseTimeToLiveRequest(ID=lease_id)
        response = await self._call(
            lambda c, t: c.lease.LeaseTimeToLive(request, timeout=t), what="lease time-to-live"
        )
        return max(int(response.TTL), 0)  # etcd answers -1 for an expired or unknown lease

    async def keepalive_once(self, lease_id: int) -> int:
        """Refresh a lease once; returns its TTL in seconds, 0 if the lease is gone."""

        async def attempt(conn: Conn, seconds: float) -> int:
            call = conn.lease.LeaseKeepAlive(timeout=seconds)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                response = await call.read()
                if response is grpc.aio.EOF:
                    await raise_for_status(call)
                    raise EtcdError("etcd closed the lease keepalive stream without answering")
                return int(response.TTL)
            finally:
                call.cancel()

        return await self._call(attempt, what="lease keepalive")

    def keepalive_forever(
        self,
        ttl: int,
        *,
        lease_id: int | None = None,
        on_regrant: Callable[[int], Awaitable[None] | None] | None = None,
        revoke_on_exit: bool = True,
    ) -> LeaseKeeper:
        """A context manager that keeps a lease alive while it is entered.

        ``async with client.keepalive_forever(10, on_regrant=reregister) as keeper:`` grants a
        lease (unless ``lease_id`` is given), refreshes it every ``ttl / 3`` seconds, and if the
        lease is lost (etcd was down longer than the TTL) grants a new one and calls
        ``on_regrant(new_lease_id)`` so the owner can write its keys again. ``keeper.lease_id``
        is always the current lease. On exit the lease is revoked unless ``revoke_on_exit`` is
        false.
        """
        return LeaseKeeper(
            self, ttl, lease_id=lease_id, on_regrant=on_regrant, revoke_on_exit=revoke_on_exit
        )


def _mod_revision_equals(key: bytes, revision: int) -> Any:
    # A missing key compares as mod_revision 0, so revision 0 means "must not exist".
    return rpc.Compare(
        key=key,
        result=rpc.Compare.EQUAL,
        target=rpc.Compare.MOD,
        mod_revision=revision,
    )


def _range(request: Any, conn: Conn, seconds: float) -> Any:
    return conn.kv.Range(request, timeout=seconds)


def _txn_actual_revision(response: Any) -> int:
    kvs = response.responses[0].response_range.kvs
    return int(kvs[0].mod_revision) if kvs else 0
