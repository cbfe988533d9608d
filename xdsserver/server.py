"""The ADS gRPC service (envoy.service.discovery.v3.AggregatedDiscoveryService), SotW and Delta.

Each stream runs two coroutines: a reader that applies requests to the stream's state as they
arrive (ACK, NACK, subscriptions) and a writer that wakes on a single event, compares what the
Envoy has with what its fleet's snapshot holds, and sends the difference in make-before-break
order. The event is set by the reader and by `SnapshotCache.set_snapshot`; nothing queues, so an
Envoy that stops reading blocks only its own writer, and when it resumes it gets the newest
snapshot rather than a backlog.

The protocol state machines live in `sotw` and `delta`, over what both share in `stream`.
Protocol rules and where they come from: Envoy's xds_protocol doc and /work/shared/design.md
("xDS server rules").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from xdsserver.delta import DeltaStream
from xdsserver.identity import FleetBinding, check_peer
from xdsserver.resources import short_name
from xdsserver.snapshot import SnapshotCache, Watch
from xdsserver.sotw import SotwStream
from xdsserver.status import ConnectionRegistry, Mode
from xdsserver.stream import Stream

log = logging.getLogger(__name__)


class AdsServer:
    """Serves each Envoy its fleet's snapshot from `cache` and reports to `status`.

    With `binding` (ADS over mutual TLS), an Envoy receives a fleet only if its client
    certificate's identity is bound to it; otherwise the stream is refused (PERMISSION_DENIED),
    recorded in `status`, and sends nothing.
    """

    def __init__(
        self,
        cache: SnapshotCache,
        status: ConnectionRegistry,
        *,
        binding: FleetBinding | None = None,
    ) -> None:
        self.cache = cache
        self.status = status
        self.binding = binding
        self._closing = False

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register both ADS methods on a grpc.aio server."""
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)

    def close(self) -> None:
        """End every open stream with OK status (Envoys reconnect, possibly elsewhere).

        Call before `server.stop(grace)` so the grace period is not spent waiting on streams
        that never end by themselves.
        """
        self._closing = True
        for watch in self.cache.watches():
            watch.event.set()

    # grpc.aio tells streaming handlers apart by inspect.isasyncgenfunction: these must be
    # async generators themselves, not functions returning one.
    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async with aclosing(self._serve(request_iterator, context, "sotw")) as responses:
            async for response in responses:
                yield response

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async with aclosing(self._serve(request_iterator, context, "delta")) as responses:
            async for response in responses:
                yield response

    async def _serve(
        self,
        request_iterator: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
        mode: Mode,
    ) -> AsyncGenerator[Any, None]:
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if self._closing:
            return
        # The bootstrap sets set_node_on_first_message_only: only this request carries the node.
        node = first.node
        node_id = str(node.id)
        fleet = self.cache.fleet_for(node)
        peer = str(context.peer())
        check = check_peer(self.binding, context.auth_context(), fleet)
        identity = check.identity
        if check.refusal is not None:
            reason, message = check.refusal
            log.warning(
                "xDS refused node=%s fleet=%s identity=%s peer=%s: %s",
                node_id,
                fleet,
                identity,
                peer,
                message,
            )
            self.status.refused(
                node_id=node_id,
                fleet=fleet,
                identity=identity,
                peer=peer,
                reason=reason,
                message=message,
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        # An Envoy of a fleet with views per place watches the view of its node.locality.
        view = self.cache.view_for(node)
        watch = self.cache.watch(view)
        conn = self.status.open(
            node_id=node_id, fleet=fleet, peer=peer, mode=mode, identity=identity
        )
        log.info(
            "xDS connect node=%s fleet=%s mode=%s peer=%s identity=%s",
            node_id,
            fleet,
            mode,
            peer,
            identity,
        )
        stream: Stream[Any] = (
            SotwStream(conn, self.status) if mode == "sotw" else DeltaStream(conn, self.status)
        )
        stream.handle(first)
        reader = asyncio.create_task(self._read(requests, stream, watch))
        try:
            while not self._closing and not stream.done:
                changed_at = watch.consume()
                snapshot = self.cache.snapshot_for(view)
                for push in stream.plan(snapshot):
                    log.debug(
                        "xDS push node=%s fleet=%s type=%s version=%s nonce=%s",
                        node_id,
                        fleet,
                        short_name(push.type_url),
                        push.version,
                        push.nonce,
                    )
                    yield push.response
                    self.status.sent(
                        conn,
                        push.type_url,
                        version=push.version,
                        nonce=push.nonce,
                        changed_at=changed_at,
                    )
                if not watch.event.is_set():
                    # A hold of routes behind warming clusters ends by itself at its limit.
                    wake_in = stream.wake_in()
                    if wake_in is None:
                        await watch.event.wait()
                    else:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(wake_in):
                                await watch.event.wait()
        finally:
            reader.cancel()
            self.cache.unwatch(watch)
            self.status.close(conn)
            log.info("xDS disconnect node=%s fleet=%s mode=%s peer=%s", node_id, fleet, mode, peer)

    @staticmethod
    async def _read(requests: AsyncIterator[Any], stream: Stream[Any], watch: Watch) -> None:
        try:
            async for request in requests:
                try:
                    stream.handle(request)
                except Exception:
                    log.exception("xDS request from node=%s failed", stream.conn.node_id)
                    raise
                watch.event.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The peer went away mid-read, or handle() failed (logged above): the writer ends
            # the stream.
            log.debug("xDS stream read ended: %r", exc)
        finally:
            stream.done = True
            watch.event.set()
