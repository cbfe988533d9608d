"""The connection under ``EtcdClient``: gRPC channels to etcd's endpoints, the auth token
each carries, and the one retry and failover policy every call goes through.

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
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import grpc
from aetcd import rpc

from controlplane.etcd.security import AuthToken, EtcdSecurity, access_problem, is_bad_token
from controlplane.etcd.types import (
    CompactedError,
    EtcdAccessDenied,
    EtcdClosed,
    EtcdError,
    EtcdOutcomeUnknown,
    EtcdUnavailable,
    LeaseNotFoundError,
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


def is_compacted(err: grpc.aio.AioRpcError) -> bool:
    return err.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (err.details() or "")


def _never_sent(err: grpc.aio.AioRpcError) -> bool:
    """True when gRPC failed before the request reached a server (safe to retry a write)."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (
        err.details() or ""
    )


@dataclass(slots=True)
class Conn:
    endpoint: str
    channel: grpc.aio.Channel
    kv: Any
    watch: Any
    lease: Any
    maintenance: Any
    auth: Any
    token: AuthToken


class EtcdConnection:
    """Channels to several etcd endpoints, one in use at a time: a call moves to the next when
    the current one is unreachable, within the call's timeout. ``EtcdClient`` adds etcd's
    calls on top."""

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
            raise ValueError("an etcd client needs at least one endpoint")
        self._targets = [_normalize_endpoint(e) for e in endpoints]
        self.timeout = timeout
        self.security = security or EtcdSecurity()
        self._conns: list[Conn] = []
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
                Conn(
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

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- plumbing ---------------------------------------------------------------------------

    async def _conn(self) -> Conn:
        if not self._conns:
            if self._closed:
                raise EtcdClosed("the etcd client is closed")
            await self.connect()
        return self._conns[self._current]

    def _closed_under_call(self) -> bool:
        """Whether a CancelledError out of a call means this client was closed under it:
        closing cancels the calls in flight, and gRPC raises that in the caller's task although
        nobody cancelled the task."""
        task = asyncio.current_task()
        return self._closed and task is not None and not task.cancelling()

    def _rotate(self, failed: Conn) -> None:
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
        attempt: Callable[[Conn, float], Awaitable[T]],
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
            except asyncio.CancelledError:
                if self._closed_under_call():
                    raise EtcdClosed(f"the etcd client was closed during {what}") from None
                raise
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

    async def _authenticate(self, conn: Conn, seconds: float) -> None:
        """Get an auth token for ``conn`` with the configured user and password."""
        request = rpc.AuthenticateRequest(
            name=self.security.user or "", password=self.security.password or ""
        )
        response = await conn.auth.Authenticate(request, timeout=seconds)
        conn.token.value = str(response.token)

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


async def raise_for_status(call: Any) -> None:
    code = await call.code()
    if code != grpc.StatusCode.OK:
        details = await call.details()
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _translate(err: grpc.aio.AioRpcError, what: str) -> EtcdError:
    details = err.details() or ""
    if is_compacted(err):
        return CompactedError(0)
    if err.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseNotFoundError(
            f"{what}: the lease has expired or was revoked; grant a new lease and write again"
        )
    if err.code() == grpc.StatusCode.CANCELLED:
        return EtcdError(f"{what} was cancelled (is the client closing?)")
    return EtcdError(f"etcd rejected {what}: {err.code().name} {details}")
