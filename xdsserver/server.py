"""The ADS gRPC service (envoy.service.discovery.v3.AggregatedDiscoveryService), SotW and Delta.

Each stream runs two coroutines: a reader that applies requests to the stream's state as they
arrive (ACK, NACK, subscriptions) and a writer that wakes on a single event, compares what the
Envoy has with what its fleet's snapshot holds, and sends the difference in make-before-break
order. The event is set by the reader and by `SnapshotCache.set_snapshot`; nothing queues, so an
Envoy that stops reading blocks only its own writer, and when it resumes it gets the newest
snapshot rather than a backlog.

Protocol rules and where they come from: Envoy's xds_protocol doc and /work/shared/design.md
("xDS server rules").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xdsserver.identity import FleetBinding, PeerIdentity
from xdsserver.resources import (
    CLUSTER,
    ENDPOINT,
    LISTENER,
    PUSH_ORDER,
    REMOVE_ORDER,
    ROUTE,
    WILDCARD_TYPES,
    Resource,
    content_version,
    short_name,
)
from xdsserver.snapshot import Snapshot, SnapshotCache, Watch
from xdsserver.status import ConnectionRegistry, ConnectionStatus, Mode

log = logging.getLogger(__name__)

WILDCARD = "*"

# After a cluster (listener) update Envoy re-requests the endpoints (routes) of the clusters
# (listeners) it rebuilt, often with an unchanged name set; a rebuilt cluster only finishes
# warming when its ClusterLoadAssignment arrives, so that request must be answered.
_ANSWER_NEXT_REQUEST = {CLUSTER: ENDPOINT, LISTENER: ROUTE}
_LEADER = {follower: leader for leader, follower in _ANSWER_NEXT_REQUEST.items()}


def _ordered(types: Iterable[str], order: tuple[str, ...]) -> list[str]:
    rank = {t: i for i, t in enumerate(order)}
    return sorted(types, key=lambda t: (rank.get(t, len(order)), t))


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
        identity = ""
        if self.binding is not None:
            peer_identity = PeerIdentity.from_auth_context(context.auth_context())
            identity = peer_identity.describe() if peer_identity is not None else ""
            refusal = self.binding.refusal(peer_identity, fleet)
            if refusal is not None:
                reason, message = refusal
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
        watch = self.cache.watch(fleet)
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
        stream: _Stream = (
            _SotwStream(conn, self.status) if mode == "sotw" else _DeltaStream(conn, self.status)
        )
        stream.handle(first)
        reader = asyncio.create_task(self._read(requests, stream, watch))
        try:
            while not self._closing and not stream.done:
                changed_at = watch.consume()
                snapshot = self.cache.snapshot_for(fleet)
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
                    await watch.event.wait()
        finally:
            reader.cancel()
            self.cache.unwatch(watch)
            self.status.close(conn)
            log.info("xDS disconnect node=%s fleet=%s mode=%s peer=%s", node_id, fleet, mode, peer)

    @staticmethod
    async def _read(requests: AsyncIterator[Any], stream: _Stream, watch: Watch) -> None:
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


@dataclass(slots=True)
class _Push:
    type_url: str
    version: str
    nonce: str
    response: Any


class _Stream:
    """State shared by both protocol variants: nonces, status reporting, completion."""

    def __init__(self, conn: ConnectionStatus, status: ConnectionRegistry) -> None:
        self.conn = conn
        self.status = status
        self.done = False
        self._nonce_prefix = secrets.token_hex(4)
        self._nonce_counter = itertools.count(1)

    def next_nonce(self) -> str:
        return f"{self._nonce_prefix}-{next(self._nonce_counter)}"

    def handle(self, request: Any) -> None:
        raise NotImplementedError

    def plan(self, snapshot: Snapshot | None) -> list[_Push]:
        """Responses to send now, in order, with the stream state already updated for them."""
        raise NotImplementedError

    def request_type(self, request: Any) -> str | None:
        """The request's type URL; None (logged) for a request without one, which is ignored."""
        type_url = str(request.type_url)
        if not type_url:
            log.warning("xDS request without type_url from node=%s ignored", self.conn.node_id)
            return None
        return type_url

    def log_stale(self, type_url: str) -> None:
        log.debug("xDS stale nonce node=%s type=%s", self.conn.node_id, short_name(type_url))

    def record_nack(self, type_url: str, version: str, request: Any) -> None:
        message = str(request.error_detail.message)
        log.warning(
            "xDS NACK node=%s fleet=%s type=%s version=%s error=%s",
            self.conn.node_id,
            self.conn.fleet,
            short_name(type_url),
            version,
            message,
        )
        self.status.nacked(
            self.conn, type_url, version=version, nonce=request.response_nonce, message=message
        )


# State of the world --------------------------------------------------------------------------


@dataclass(slots=True)
class _SotwType:
    type_url: str
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    ordered: tuple[str, ...] = ()
    """``names`` sorted, kept with them: every evaluation walks them in this order."""
    nonce: str = ""
    """Nonce of the latest response: requests carrying another one are stale."""
    sent: dict[str, Resource] | None = None
    """What the latest response held (None: nothing sent on this stream yet)."""
    sent_version: str = ""
    client_version: str = ""
    """version_info of the first request: what the Envoy had before this stream."""
    respond: bool = True
    """Answer at the next evaluation even if nothing changed."""
    respond_to_next_request: bool = False
    hold_version: str | None = None
    """After a NACK: the snapshot version rejected; nothing is sent until it changes."""
    dirty: bool = True
    seen_version: str = ""
    partial: bool = False
    """The next response carries only the resources that changed since the last one."""


class _SotwStream(_Stream):
    def __init__(self, conn: ConnectionStatus, status: ConnectionRegistry) -> None:
        super().__init__(conn, status)
        self.types: dict[str, _SotwType] = {}

    def handle(self, request: Any) -> None:
        type_url = self.request_type(request)
        if type_url is None:
            return
        st = self.types.get(type_url)
        if st is None:
            st = self.types[type_url] = _SotwType(type_url, client_version=request.version_info)
        nonce = str(request.response_nonce)
        if nonce and nonce != st.nonce:
            # Stale: the Envoy has not seen our latest response yet and will send another request
            # after it has; acting on this one could resend or undo config.
            self.log_stale(type_url)
            return
        names = [str(n) for n in request.resource_names]
        wildcard = WILDCARD in names or (not names and type_url in WILDCARD_TYPES)
        subscription = frozenset(n for n in names if n != WILDCARD)
        if (wildcard, subscription) != (st.wildcard, st.names):
            changed = st.sent is not None
            st.wildcard, st.names, st.ordered = wildcard, subscription, tuple(sorted(subscription))
            st.dirty = True
            # A new subscription is answered with everything it names (full set).
            st.respond = st.respond or changed
            self.status.subscribed(self.conn, type_url, subscription, wildcard=wildcard)
        if request.HasField("error_detail"):
            # Never answer a NACK with the same config (endless loop). The Envoy keeps its last
            # good version; the next different snapshot flows normally.
            self.record_nack(type_url, st.sent_version, request)
            st.hold_version = st.seen_version
            return
        if nonce:
            self.status.acked(self.conn, type_url, version=str(request.version_info))
        if st.respond_to_next_request:
            st.respond_to_next_request = False
            st.respond = True

    def _evaluate(self, st: _SotwType, snapshot: Snapshot) -> dict[str, Resource] | None:
        """The resources to send for one type, or None if the Envoy is up to date."""
        version = snapshot.version(st.type_url)
        if not version:
            return None  # the type is absent: the Envoy waits, as it would for a slow server
        if not st.dirty and not st.respond and version == st.seen_version:
            return None
        st.dirty = False
        st.seen_version = version
        if st.hold_version is not None and not st.respond:
            # The rejected version is not pushed again; a request that must be answered (new
            # names, a rebuilt cluster warming) still is.
            if version == st.hold_version:
                return None
            st.hold_version = None
        resources = snapshot.resources(st.type_url)
        if st.wildcard:
            items = dict(resources)
        else:
            # EDS and RDS are named: send what was asked for and exists; names that do not
            # exist yet stay in st.names and go out when they appear.
            items = {n: resources[n] for n in st.ordered if n in resources}
        if st.sent is None:
            if st.client_version == version and (st.wildcard or self._leader_resumed(st)):
                # Reconnect (maybe to another replica): content-hash versions say the Envoy
                # already has exactly this set, and for a named type the names it asks for.
                st.sent, st.sent_version, st.respond = items, version, False
                self.status.resumed(self.conn, st.type_url, version=version)
                return None
            if not items and not st.wildcard:
                st.respond = False
                return None
        elif not st.respond and _same(items, st.sent):
            return None
        # A push of a named type (EDS, RDS) carries only what changed: in SotW only CDS and LDS
        # responses must hold the full set, and Envoy keeps the named resources a response
        # leaves out. An answer to a request (new names, a re-created cluster warming) holds
        # everything asked for.
        # A re-request still owed after an earlier leader push is answered by this one.
        st.partial = (
            not st.wildcard
            and not st.respond
            and not st.respond_to_next_request
            and st.sent is not None
        )
        st.respond = False
        return items

    def _leader_resumed(self, st: _SotwType) -> bool:
        """Whether the Envoy kept its clusters (listeners) on this stream without a push: only
        then do its EDS (RDS) names and version still describe what it has. A cluster that is
        pushed, even in this same round, warms until its ClusterLoadAssignment is answered."""
        leader = self.types.get(_LEADER.get(st.type_url, ""))
        return leader is not None and leader.sent is not None and not leader.nonce

    def plan(self, snapshot: Snapshot | None) -> list[_Push]:
        if snapshot is None:
            return []
        changes: list[tuple[_SotwType, dict[str, Resource]]] = []
        for type_url in _ordered(self.types, PUSH_ORDER):
            st = self.types[type_url]
            items = self._evaluate(st, snapshot)
            if items is not None:
                changes.append((st, items))
        # A follower pushed in the round of its leader holds its whole named set: the leader's
        # rebuilt clusters (listeners) warm until theirs arrive, and Envoy's re-request for
        # them will carry a nonce that is stale by then.
        pushed = {st.type_url for st, _ in changes}
        for st, _ in changes:
            if _LEADER.get(st.type_url) in pushed:
                st.partial = False
        # Make-before-break: when a full-set type (CDS/LDS) drops names in a round that also
        # changes other types, first send the union (old kept), then the final set after the
        # rest, so nothing the new routes still reference disappears first.
        first: list[tuple[_SotwType, dict[str, Resource], str]] = []
        last: list[tuple[_SotwType, dict[str, Resource], str]] = []
        for st, items in changes:
            final_version = snapshot.version(st.type_url)
            dropped = (st.sent.keys() - items.keys()) if st.sent else set()
            if len(changes) > 1 and st.wildcard and dropped and st.sent is not None:
                union = {n: st.sent[n] for n in dropped} | items
                first.append((st, union, content_version((n, r.version) for n, r in union.items())))
                last.append((st, items, final_version))
            else:
                first.append((st, items, final_version))
        rank = {t: i for i, t in enumerate(REMOVE_ORDER)}
        last.sort(key=lambda c: rank.get(c[0].type_url, len(rank)))
        pushes = []
        for i, (st, items, version) in enumerate(first + last):
            pushes.append(self._commit(st, items, version, makes=i < len(first)))
        return pushes

    def _commit(
        self, st: _SotwType, items: dict[str, Resource], version: str, *, makes: bool
    ) -> _Push:
        nonce = self.next_nonce()
        body = items
        if st.partial and st.sent is not None:
            sent = st.sent
            body = {
                n: r
                for n, r in items.items()
                if n not in sent or (sent[n] is not r and sent[n].version != r.version)
            }
            st.partial = False
        st.nonce, st.sent, st.sent_version = nonce, items, version
        follower = _ANSWER_NEXT_REQUEST.get(st.type_url)
        if follower is not None and makes:
            self.types.setdefault(follower, _SotwType(follower)).respond_to_next_request = True
        # This response carries the whole named set (never partial while a re-request is owed
        # or in a round that pushed its leader), so that re-request is answered already.
        st.respond_to_next_request = False
        response = discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=st.type_url, nonce=nonce
        )
        response.resources.extend([r.body for r in body.values()])
        return _Push(st.type_url, version, nonce, response)


def _same(items: Mapping[str, Resource], sent: Mapping[str, Resource]) -> bool:
    if items.keys() != sent.keys():
        return False
    return all(sent[n] is r or sent[n].version == r.version for n, r in items.items())


# Delta (incremental) ---------------------------------------------------------------------------


@dataclass(slots=True)
class _DeltaType:
    type_url: str
    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    ordered: tuple[str, ...] = ()
    """``names`` sorted, refreshed when the subscription changes."""
    sent: dict[str, str] = field(default_factory=dict)
    """Name → version the Envoy has (from initial_resource_versions and what was sent)."""
    nonce: str = ""
    nonce_version: str = ""
    """system_version_info of the latest response."""
    dirty: bool = True
    seen_version: str = ""
    resuming: bool = False
    """The Envoy came with initial_resource_versions and nothing was sent since."""


@dataclass(slots=True)
class _DeltaChange:
    st: _DeltaType
    version: str
    updates: list[Resource]
    removals: list[str]


class _DeltaStream(_Stream):
    def __init__(self, conn: ConnectionStatus, status: ConnectionRegistry) -> None:
        super().__init__(conn, status)
        self.types: dict[str, _DeltaType] = {}

    def handle(self, request: Any) -> None:
        type_url = self.request_type(request)
        if type_url is None:
            return
        st = self.types.get(type_url)
        first = st is None
        subscribe = [str(n) for n in request.resource_names_subscribe]
        unsubscribe = [str(n) for n in request.resource_names_unsubscribe]
        if st is None:
            st = self.types[type_url] = _DeltaType(type_url)
            # Reconnect: the Envoy already has these; send only what differs.
            st.sent = {str(k): str(v) for k, v in request.initial_resource_versions.items()}
            st.resuming = bool(st.sent)
            # Legacy wildcard: a first request naming nothing subscribes to everything.
            st.wildcard = not subscribe and type_url in WILDCARD_TYPES
        # Subscription changes apply even on a stale nonce (protocol: "the server must process
        # subscription changes in every request").
        for name in subscribe:
            if name == WILDCARD:
                st.wildcard = True
                continue
            st.names.add(name)
            if not (first and name in request.initial_resource_versions):
                st.sent.pop(name, None)  # a (re)subscription is always answered
        for name in unsubscribe:
            if name == WILDCARD:
                st.wildcard = False
                st.sent = {n: v for n, v in st.sent.items() if n in st.names}
                continue
            st.names.discard(name)
            if not st.wildcard:
                st.sent.pop(name, None)  # the Envoy dropped it itself
        if first or subscribe or unsubscribe:
            st.dirty = True
            st.ordered = tuple(sorted(st.names))
            self.status.subscribed(self.conn, type_url, st.names, wildcard=st.wildcard)
        nonce = str(request.response_nonce)
        if not nonce:
            return
        if nonce != st.nonce:
            self.log_stale(type_url)
        elif request.HasField("error_detail"):
            # The Envoy keeps what it had; `sent` already holds the rejected versions, so
            # nothing is resent until the snapshot changes.
            self.record_nack(type_url, st.nonce_version, request)
        else:
            self.status.acked(self.conn, type_url, version=st.nonce_version)

    def _evaluate(self, st: _DeltaType, snapshot: Snapshot) -> _DeltaChange | None:
        version = snapshot.version(st.type_url)
        if not version:
            return None
        if not st.dirty and version == st.seen_version:
            return None
        st.dirty, st.seen_version = False, version
        resources = snapshot.resources(st.type_url)
        candidates: Iterable[Resource]
        if st.wildcard:
            candidates = resources.values()
        else:
            candidates = [resources[n] for n in st.ordered if n in resources]
            # Names the Envoy reported having but is not subscribed to are not ours to manage.
            for name in [n for n in st.sent if n not in st.names]:
                del st.sent[name]
        updates = [r for r in candidates if st.sent.get(r.name) != r.version]
        removals = sorted(n for n in st.sent if n not in resources)
        if not updates and not removals:
            if st.resuming:
                # A reconnect that needs nothing: the Envoy holds this version already.
                self.status.resumed(self.conn, st.type_url, version=version)
                return None
            if not (st.wildcard and not st.nonce):
                return None
            # A new wildcard subscription to an empty set still gets an (empty) answer, or the
            # Envoy would wait out its initial_fetch_timeout before it counts as initialized.
        return _DeltaChange(st, version, updates, removals)

    def plan(self, snapshot: Snapshot | None) -> list[_Push]:
        if snapshot is None:
            return []
        changes = []
        for type_url in _ordered(self.types, PUSH_ORDER):
            change = self._evaluate(self.types[type_url], snapshot)
            if change is None:
                continue
            changes.append(change)
            follower = self.types.get(_ANSWER_NEXT_REQUEST.get(type_url, ""))
            if type_url == CLUSTER and follower is not None:
                # A rebuilt or added cluster warms until its ClusterLoadAssignment arrives, and
                # in Delta Envoy does not re-subscribe a name it already watches: resend the
                # assignment each one reads (its EDS service name, shared by affinity twins).
                for r in change.updates:
                    service = r.message.eds_cluster_config.service_name or r.name
                    if follower.sent.pop(service, None) is not None:
                        follower.dirty = True
        if len(changes) <= 1:
            return [self._commit(c.st, c.version, c.updates, c.removals) for c in changes]
        # Make-before-break: every add and update (CDS → EDS → LDS → RDS), then removals
        # referrer first (LDS → RDS → CDS → EDS).
        # (A change with neither updates nor removals is the empty answer to a new wildcard
        # subscription: it goes out too.)
        pushes = [
            self._commit(c.st, c.version, c.updates, [])
            for c in changes
            if c.updates or not c.removals
        ]
        by_type = {c.st.type_url: c for c in changes if c.removals}
        for type_url in _ordered(by_type, REMOVE_ORDER):
            c = by_type[type_url]
            pushes.append(self._commit(c.st, c.version, [], c.removals))
        return pushes

    def _commit(
        self, st: _DeltaType, version: str, updates: list[Resource], removals: list[str]
    ) -> _Push:
        nonce = self.next_nonce()
        st.nonce, st.nonce_version, st.resuming = nonce, version, False
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=version,
            type_url=st.type_url,
            nonce=nonce,
            removed_resources=removals,
        )
        response.resources.extend(
            [
                discovery_pb2.Resource(name=r.name, version=r.version, resource=r.body)
                for r in updates
            ]
        )
        for r in updates:
            st.sent[r.name] = r.version
        for name in removals:
            st.sent.pop(name, None)
        return _Push(st.type_url, version, nonce, response)
