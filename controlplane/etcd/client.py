"""A thin, typed asyncio client for the etcd v3 API.

Built directly on aetcd's generated gRPC stubs over ``grpc.aio`` channels, because the
daemon needs what aetcd's high-level client hides: response header revisions, a watch that
reports compaction and broken streams as typed errors (so the caller can resume or re-list),
and explicit control over reconnects.

Failure model, in one place:

- ``EtcdUnavailable``: no endpoint answered within the call's timeout. Unary calls rotate to
  the next endpoint on ``UNAVAILABLE`` and retry with a short backoff until the timeout runs
  out. Conditional writes are retried only when the request provably never left the client
  (gRPC could not connect), so a retry cannot turn a successful create into a conflict.
- ``EtcdOutcomeUnknown`` (an ``EtcdUnavailable``): a write reached etcd, or may have, and was
  not confirmed in time (etcd frozen, a leader election, a partition). It may be applied later
  or not at all, as etcd's own clients warn: read the key back before retrying.
- ``ConflictError``: a compare-and-swap failed; carries the key's actual ``mod_revision``.
- ``CompactedError``: a watch asked for history etcd has already compacted; re-list.
- ``EtcdAccessDenied``: etcd refused who we are (a TLS handshake it rejected, a wrong user or
  password, a role without permission for the key). Retrying cannot help; the message says
  which setting to check.

Security (``EtcdSecurity``): TLS with a CA bundle and a client certificate, and etcd's
user/password authentication. With a user, the client asks etcd for an auth token once per
channel and sends it with every call (a gRPC interceptor adds the ``token`` metadata, which
is where etcd looks for it); an expired token is renewed and the call retried once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from aetcd import rpc

from controlplane.etcd.lease import LeaseKeeper
from controlplane.etcd.security import AuthToken, EtcdSecurity, access_problem, is_bad_token
from controlplane.etcd.types import (
    CompactedError,
    ConflictError,
    EtcdAccessDenied,
    EtcdError,
    EtcdOutcomeUnknown,
    EtcdStatus,
    EtcdUnavailable,
    EventType,
    KeyValue,
    LeaseNotFoundError,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC channel options. The reconnect backoff caps matter: with gRPC's defaults (up to 120 s)
# a client could sit in backoff for minutes after etcd comes back.
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Detect a dead peer on an idle watch stream. etcd's default --grpc-keepalive-min-time is
    # 5 s; pinging more often than that gets the connection closed with "too_many_pings".
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
]

# clientv3.WithRequireLeader: a member cut off from its cluster cancels the watch instead of
# silently delivering nothing.
_REQUIRE_LEADER = (("hasleader", "true"),)

_RANGE_PAGE_SIZE = 1000


def _normalize_endpoint(endpoint: str) -> tuple[str, bool]:
    """``host:port``, ``http://host:port`` or ``https://host:port`` -> (target, tls)."""
    endpoint = endpoint.strip()
    tls = False
    if endpoint.startswith("https://"):
        endpoint, tls = endpoint[len("https://") :], True
    elif endpoint.startswith("http://"):
        endpoint = endpoint[len("http://") :]
    endpoint = endpoint.rstrip("/")
    if not endpoint or ":" not in endpoint:
        raise ValueError(f"etcd endpoint {endpoint!r} must look like host:port or http://host:port")
    return endpoint, tls


def _is_compacted(err: grpc.aio.AioRpcError) -> bool:
    return err.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (err.details() or "")


def _never_sent(err: grpc.aio.AioRpcError) -> bool:
    """True when gRPC failed before the request reached a server (safe to retry a write)."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (
        err.details() or ""
    )


@dataclass(slots=True)
class _Conn:
    endpoint: str
    channel: grpc.aio.Channel
    kv: Any
    watch: Any
    lease: Any
    maintenance: Any
    auth: Any
    token: AuthToken


MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: the most operations one transaction may hold."""


class EtcdClient:
    """An etcd v3 client. Use as ``async with EtcdClient(["127.0.0.1:2379"]) as client``.

    Several endpoints may be given; calls go to one at a time and move to the next when the
    current one is unreachable.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._targets = [_normalize_endpoint(e) for e in endpoints]
        self.timeout = timeout
        self.security = security or EtcdSecurity()
        self._conns: list[_Conn] = []
        self._current = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return [target for target, _ in self._targets]

    @property
    def current_endpoint(self) -> str:
        return self._targets[self._current][0]

    async def connect(self) -> None:
        """Create the gRPC channels. No I/O: etcd may still be down when this returns."""
        if self._conns:
            return
        self._closed = False
        credentials = self.security.channel_credentials() if self.security.tls else None
        for target, tls in self._targets:
            token = AuthToken()
            if tls or credentials is not None:
                channel = grpc.aio.secure_channel(
                    target,
                    credentials or grpc.ssl_channel_credentials(),
                    options=_CHANNEL_OPTIONS,
                    interceptors=[token],
                )
            else:
                channel = grpc.aio.insecure_channel(
                    target, options=_CHANNEL_OPTIONS, interceptors=[token]
                )
            self._conns.append(
                _Conn(
                    endpoint=target,
                    channel=channel,
                    kv=rpc.KVStub(channel),
                    watch=rpc.WatchStub(channel),
                    lease=rpc.LeaseStub(channel),
                    maintenance=rpc.MaintenanceStub(channel),
                    auth=rpc.AuthStub(channel),
                    token=token,
                )
            )

    async def close(self) -> None:
        conns, self._conns = self._conns, []
        self._closed = True
        for conn in conns:
            await conn.channel.close()

    async def __aenter__(self) -> EtcdClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- plumbing ---------------------------------------------------------------------------

    async def _conn(self) -> _Conn:
        if not self._conns:
            if self._closed:
                raise EtcdError("the etcd client is closed")
            await self.connect()
        return self._conns[self._current]

    def _rotate(self, failed: _Conn) -> None:
        """Move to the next endpoint, unless another call already moved away from ``failed``."""
        if self._conns and self._conns[self._current] is failed:
            self._current = (self._current + 1) % len(self._conns)
            if len(self._conns) > 1:
                log.info(
                    "etcd endpoint %s unreachable, trying %s",
                    failed.endpoint,
                    self.current_endpoint,
                )

    async def _call(
        self,
        attempt: Callable[[_Conn, float], Awaitable[T]],
        *,
        what: str,
        idempotent: bool = True,
        write: bool = False,
        budget: float | None = None,
    ) -> T:
        """Run ``attempt(conn, seconds_left)``, rotating endpoints on UNAVAILABLE until the timeout.

        A ``write`` that may have reached etcd and was not confirmed ends in
        ``EtcdOutcomeUnknown`` rather than a plain ``EtcdUnavailable``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if budget is None else budget)
        delay = 0.05
        tried_in_round = 0
        renewed = False
        last: grpc.aio.AioRpcError | None = None
        maybe_applied = False
        while True:
            conn = await self._conn()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._unavailable(what, last, maybe_applied=maybe_applied)
            per_attempt = remaining
            if idempotent and len(self._conns) > 1:
                # A black-holed endpoint must not eat the whole budget.
                per_attempt = min(remaining, max(self.timeout / len(self._conns), 0.5))
            try:
                if self.security.user is not None and conn.token.value is None:
                    await self._authenticate(conn, per_attempt)
                return await attempt(conn, per_attempt)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if is_bad_token(err) and not renewed:
                    # The token expired (etcd's simple tokens live 5 minutes idle): renew it
                    # once. The request was refused, so even a write is safe to repeat.
                    conn.token.value = None
                    renewed = True
                    continue
                problem = access_problem(err)
                if problem is not None:
                    raise EtcdAccessDenied(
                        f"{problem}; {what} at {conn.endpoint} failed: {err.details()}"
                    ) from None
                maybe_applied = maybe_applied or (write and not _never_sent(err))
                retryable = code == grpc.StatusCode.UNAVAILABLE or (
                    code == grpc.StatusCode.DEADLINE_EXCEEDED and per_attempt < remaining
                )
                if not retryable:
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise self._unavailable(what, err, maybe_applied=maybe_applied) from None
                    raise _translate(err, what) from None
                if not idempotent and not _never_sent(err):
                    raise EtcdOutcomeUnknown(
                        f"etcd at {conn.endpoint} failed during {what} ({err.details()}); "
                        "the write may or may not have been applied: re-read before retrying"
                    ) from None
                last = err
                self._rotate(conn)
                tried_in_round += 1
                if tried_in_round >= len(self._conns):
                    tried_in_round = 0
                    left = deadline - loop.time()
                    if left <= 0:
                        raise self._unavailable(what, last, maybe_applied=maybe_applied) from None
                    await asyncio.sleep(min(delay * (0.5 + random.random()), left))
                    delay = min(delay * 2, 1.0)

    async def _authenticate(self, conn: _Conn, seconds: float) -> None:
        """Get an auth token for ``conn`` with the configured user and password."""
        request = rpc.AuthenticateRequest(
            name=self.security.user or "", password=self.security.password or ""
        )
        response = await conn.auth.Authenticate(request, timeout=seconds)
        conn.token.value = str(response.token)

    async def check_access(self) -> None:
        """Ask etcd for its status: raises ``EtcdAccessDenied`` when etcd refuses our TLS
        certificate or credentials (worth stopping for at start), ``EtcdUnavailable`` when
        it cannot be reached (worth waiting for)."""
        await self.status()

    def _unavailable(
        self, what: str, err: grpc.aio.AioRpcError | None, *, maybe_applied: bool = False
    ) -> EtcdError:
        if err is not None and (problem := access_problem(err)) is not None:
            return EtcdAccessDenied(f"{problem}; {what} failed: {err.details()}")
        detail = f": {err.details()}" if err is not None else ""
        if maybe_applied:
            return EtcdOutcomeUnknown(
                f"etcd at {', '.join(self.endpoints)} did not confirm {what} within "
                f"{self.timeout:g}s{detail}; the write may or may not have been applied "
                "(it can still be, once etcd recovers): re-read before retrying"
            )
        return EtcdUnavailable(
            f"cannot reach etcd at {', '.join(self.endpoints)} for {what} within "
            f"{self.timeout:g}s{detail}; check that etcd is running and the endpoints are right"
        )

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

        async def attempt(conn: _Conn, seconds: float) -> int:
            call = conn.lease.LeaseKeepAlive(timeout=seconds)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                response = await call.read()
                if response is grpc.aio.EOF:
                    await _raise_for_status(call)
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

    # -- watch ------------------------------------------------------------------------------

    async def watch_prefix(
        self, prefix: bytes, *, start_revision: int
    ) -> AsyncIterator[WatchBatch]:
        """Follow changes under ``prefix`` from ``start_revision`` (0 = from now).

        Yields one ``WatchBatch`` per etcd ``WatchResponse``, so the events of one revision
        (one transaction) stay together. The first batch is empty and means the watch is
        established. Raises ``CompactedError`` if ``start_revision`` (or a later resume point)
        was compacted, and ``EtcdUnavailable`` when the stream cannot be opened or breaks;
        resume with ``start_revision=batch.revision + 1`` of the last batch seen. Closing or
        cancelling the iterator cancels the watch.
        """
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=prefix,
                range_end=prefix_range_end(prefix),
                start_revision=start_revision,
                progress_notify=True,
            )
        )
        call, created, conn = await self._open_watch(create, prefix)
        try:
            if created.compact_revision:
                raise CompactedError(created.compact_revision, start_revision)
            if created.canceled:
                raise EtcdError(f"etcd refused the watch on {prefix!r}: {created.cancel_reason}")
            header_revision = int(created.header.revision)
            resumed_at = start_revision - 1 if start_revision > 0 else header_revision
            yield WatchBatch([], resumed_at, header_revision)
            while True:
                try:
                    response = await call.read()
                except grpc.aio.AioRpcError as err:
                    raise self._watch_broken(conn, prefix, err) from None
                if response is grpc.aio.EOF:
                    raise self._watch_broken(conn, prefix, None)
                if response.compact_revision:
                    raise CompactedError(response.compact_revision)
                if response.canceled:
                    raise EtcdUnavailable(
                        f"etcd cancelled the watch on {prefix!r}: "
                        f"{response.cancel_reason or 'no reason given'}; watch again"
                    )
                events = [_event_from_pb(e) for e in response.events]
                # With events, the header revision can run ahead of what this response carries
                # (etcd batches catch-up in chunks of revisions), so resume from the last event.
                revision = events[-1].kv.mod_revision if events else int(response.header.revision)
                yield WatchBatch(events, revision, int(response.header.revision))
        finally:
            call.cancel()

    async def _open_watch(self, create: Any, prefix: bytes) -> tuple[Any, Any, _Conn]:
        """The watch call, etcd's "created" response, and the endpoint it is open on."""

        async def attempt(conn: _Conn, seconds: float) -> tuple[Any, Any, _Conn]:
            call = conn.watch.Watch(metadata=_REQUIRE_LEADER)
            try:
                await asyncio.wait_for(call.write(create), seconds)
                created = await asyncio.wait_for(call.read(), seconds)
                if created is grpc.aio.EOF:
                    await _raise_for_status(call)
                    raise EtcdUnavailable(f"etcd closed the watch on {prefix!r} while opening it")
            except TimeoutError:
                call.cancel()
                raise EtcdUnavailable(
                    f"etcd at {conn.endpoint} did not open the watch on {prefix!r} "
                    f"within {seconds:g}s"
                ) from None
            except BaseException:
                call.cancel()
                raise
            return call, created, conn

        return await self._call(attempt, what=f"watch {prefix!r}")

    def _watch_broken(
        self, conn: _Conn, prefix: bytes, err: grpc.aio.AioRpcError | None
    ) -> EtcdError:
        if err is not None and _is_compacted(err):
            return CompactedError(0)
        # The stream broke: next time, try the next endpoint, unless another call has
        # already moved on from the one this watch was open on.
        self._rotate(conn)
        detail = err.details() if err is not None else "stream closed"
        return EtcdUnavailable(f"the watch on {prefix!r} broke ({detail}); resume it")


def _mod_revision_equals(key: bytes, revision: int) -> Any:
    # A missing key compares as mod_revision 0, so revision 0 means "must not exist".
    return rpc.Compare(
        key=key,
        result=rpc.Compare.EQUAL,
        target=rpc.Compare.MOD,
        mod_revision=revision,
    )


def _range(request: Any, conn: _Conn, seconds: float) -> Any:
    return conn.kv.Range(request, timeout=seconds)


def _txn_actual_revision(response: Any) -> int:
    kvs = response.responses[0].response_range.kvs
    return int(kvs[0].mod_revision) if kvs else 0


def _event_from_pb(event: Any) -> WatchEvent:
    kind = EventType.DELETE if event.type == rpc.Event.DELETE else EventType.PUT
    return WatchEvent(kind, KeyValue.from_pb(event.kv))


async def _raise_for_status(call: Any) -> None:
    code = await call.code()
    if code != grpc.StatusCode.OK:
        details = await call.details()
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _translate(err: grpc.aio.AioRpcError, what: str) -> EtcdError:
    details = err.details() or ""
    if _is_compacted(err):
        return CompactedError(0)
    if err.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseNotFoundError(
            f"{what}: the lease has expired or was revoked; grant a new lease and write again"
        )
    if err.code() == grpc.StatusCode.CANCELLED:
        return EtcdError(f"{what} was cancelled (is the client closing?)")
    return EtcdError(f"etcd rejected {what}: {err.code().name} {details}")
