"""etcd's watch, as the client offers it: one prefix followed from a revision, each
response a ``WatchBatch``, compaction and a broken stream surfacing as typed errors so the
caller can re-list or resume."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from aetcd import rpc

from controlplane.etcd.connection import Conn, EtcdConnection, is_compacted, raise_for_status
from controlplane.etcd.types import (
    CompactedError,
    EtcdClosed,
    EtcdError,
    EtcdUnavailable,
    EventType,
    KeyValue,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)

# clientv3.WithRequireLeader: a member cut off from its cluster cancels the watch instead of
# silently delivering nothing.
_REQUIRE_LEADER = (("hasleader", "true"),)


class EtcdWatch(EtcdConnection):
    """The watch calls of ``EtcdClient``."""

    async def watch_prefix(
        self, prefix: bytes, *, start_revision: int
    ) -> AsyncGenerator[WatchBatch, None]:
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
                except asyncio.CancelledError:
                    if self._closed_under_call():
                        raise EtcdClosed(
                            f"the etcd client was closed under the watch on {prefix!r}"
                        ) from None
                    raise
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

    async def _open_watch(self, create: Any, prefix: bytes) -> tuple[Any, Any, Conn]:
        """The watch call, etcd's "created" response, and the endpoint it is open on."""

        async def attempt(conn: Conn, seconds: float) -> tuple[Any, Any, Conn]:
            call = conn.watch.Watch(metadata=_REQUIRE_LEADER)
            try:
                async with asyncio.timeout(seconds):
                    await call.write(create)
                    created = await call.read()
                if created is grpc.aio.EOF:
                    await raise_for_status(call)
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
        self, conn: Conn, prefix: bytes, err: grpc.aio.AioRpcError | None
    ) -> EtcdError:
        if err is not None and is_compacted(err):
            return CompactedError(0)
        # The stream broke: next time, try the next endpoint, unless another call has
        # already moved on from the one this watch was open on.
        self._rotate(conn)
        detail = err.details() if err is not None else "stream closed"
        return EtcdUnavailable(f"the watch on {prefix!r} broke ({detail}); resume it")


def _event_from_pb(event: Any) -> WatchEvent:
    kind = EventType.DELETE if event.type == rpc.Event.DELETE else EventType.PUT
    return WatchEvent(kind, KeyValue.from_pb(event.kv))
