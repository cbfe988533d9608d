"""Incremental (Delta) ADS: responses carry only the resources that changed and the names
removed (xds_protocol, "Incremental xDS")."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2

from xdsserver.acceptance import Acceptance, Sent
from xdsserver.resources import (
    CLUSTER,
    ENDPOINT,
    PUSH_ORDER,
    REMOVE_ORDER,
    WILDCARD_TYPES,
    Resource,
    content_version,
)
from xdsserver.snapshot import Snapshot
from xdsserver.stream import (
    ANSWER_NEXT_REQUEST,
    ROUTING_TYPES,
    WILDCARD,
    Push,
    Stream,
    in_order,
)


@dataclass(slots=True)
class _DeltaType:
    type_url: str
    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    ordered: tuple[str, ...] = ()
    """``names`` sorted, refreshed when the subscription changes."""
    sent: dict[str, str] = field(default_factory=dict)
    """Name → version the Envoy has or was sent (from initial_resource_versions and what was
    sent; after a NACK, what it accepted)."""
    nonce: str = ""
    dirty: bool = True
    seen_version: str = ""
    resuming: bool = False
    """The Envoy came with initial_resource_versions and nothing was sent since."""
    acceptance: Acceptance[str] = field(default_factory=Acceptance)
    """Name → version the Envoy runs (ACKed, or reported on reconnect); rejected versions."""
    deferred: bool = False
    """Removals were held back while routes waited: evaluate again at the next plan."""


@dataclass(slots=True)
class _DeltaChange:
    st: _DeltaType
    version: str
    updates: list[Resource]
    removals: list[str]


class DeltaStream(Stream[_DeltaType]):
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
            st.acceptance = Acceptance(st.sent)
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
                st.acceptance.accepted.pop(name, None)
        if first or subscribe or unsubscribe:
            st.dirty = True
            st.ordered = tuple(sorted(st.names))
            self.status.subscribed(self.conn, type_url, st.names, wildcard=st.wildcard)
        nonce = str(request.response_nonce)
        if not nonce:
            return
        answer = self.settle(st.acceptance, type_url, nonce, request)
        if answer is None:
            if nonce != st.nonce:
                self.log_stale(type_url)
            return
        if answer.nacked:
            # The Envoy keeps what it had. The rejected version is held (not sent again); the
            # names it changed go back to what the Envoy runs, so the next version still
            # holding them carries them again.
            accepted = st.acceptance.accepted
            for name, version in answer.sent.updates.items():
                if st.sent.get(name) == version:
                    _restore(st.sent, name, accepted.get(name))
            for name in answer.sent.removals:
                if name not in st.sent:
                    _restore(st.sent, name, accepted.get(name))

    def _evaluate(self, st: _DeltaType, snapshot: Snapshot) -> _DeltaChange | None:
        version = snapshot.version(st.type_url)
        if not version:
            return None
        if not st.dirty and not st.deferred and version == st.seen_version:
            return None
        st.deferred = False
        held = not st.dirty and st.acceptance.rejected(version)
        st.dirty, st.seen_version = False, version
        if held:
            return None  # the Envoy rejected this version; a (re)subscription is still answered
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

    def plan(self, snapshot: Snapshot | None) -> list[Push]:
        held = self.routes_held()  # first: it also ends a hold that reached its limit
        if snapshot is None:
            return []
        changes = []
        for type_url in in_order(self.types, PUSH_ORDER):
            if type_url in ROUTING_TYPES and held:
                continue  # evaluated once the clusters warmed; their state waits untouched
            change = self._evaluate(self.types[type_url], snapshot)
            if change is None:
                continue
            st = change.st
            # Once the Envoy rejected the set it would hold with the removals kept back, the
            # updates go with the removals in the old make-before-break order (below):
            # holding the routes for clusters it already turned down would not help them.
            kept_version = _kept_version(st, change.updates) if change.removals else ""
            kept_rejected = bool(kept_version) and st.acceptance.rejected(kept_version)
            if type_url == CLUSTER and not kept_rejected:
                held = held or any(r.name not in st.acceptance.accepted for r in change.updates)
            if held and change.removals:
                # What current routes may still reference stays until they move: the removals
                # go out with the routes, and this push is labelled with the set it leaves.
                st.deferred = True
                if kept_rejected:
                    continue  # all of it waits for the routes
                change.removals, change.version = [], kept_version
                if not change.updates:
                    continue
            changes.append(change)
            follower = self.types.get(ANSWER_NEXT_REQUEST.get(type_url, ""))
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
        # An updates push that removals follow is labelled with the set the Envoy holds after
        # it (old names kept), as a SotW union is: a NACK of it then rejects that set, not the
        # snapshot version the removals push carries. Once that set was rejected, the type's
        # updates go out with its removals instead.
        pushes = []
        merged: set[str] = set()
        for c in changes:
            if not c.updates and c.removals:
                continue
            version = c.version
            if c.removals:
                version = _kept_version(c.st, c.updates)
                if c.st.acceptance.rejected(version):
                    merged.add(c.st.type_url)
                    continue
            if c.st.type_url == ENDPOINT and CLUSTER in merged:
                # The assignments of clusters pushed with the removals follow them.
                merged.add(ENDPOINT)
                continue
            pushes.append(self._commit(c.st, version, c.updates, []))
        by_type = {c.st.type_url: c for c in changes if c.removals or c.st.type_url in merged}
        for type_url in in_order(by_type, REMOVE_ORDER):
            c = by_type[type_url]
            updates = c.updates if type_url in merged else []
            pushes.append(self._commit(c.st, c.version, updates, c.removals))
        return pushes

    def _commit(
        self, st: _DeltaType, version: str, updates: list[Resource], removals: list[str]
    ) -> Push:
        nonce = self.next_nonce()
        st.nonce, st.resuming = nonce, False
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
        st.acceptance.sent(
            nonce, Sent(version, {r.name: r.version for r in updates}, tuple(removals))
        )
        if st.type_url == CLUSTER:
            added = [r.name for r in updates if r.name not in st.acceptance.accepted]
            if added:
                self.hold_routes(nonce, added)
        return Push(st.type_url, version, nonce, response)


def _kept_version(st: _DeltaType, updates: list[Resource]) -> str:
    """The version of the set the Envoy holds after `updates` while the type's removals wait
    (its old names kept), as a SotW union is labelled."""
    return content_version({**st.sent, **{r.name: r.version for r in updates}}.items())


def _restore(sent: dict[str, str], name: str, version: str | None) -> None:
    if version is None:
        sent.pop(name, None)
    else:
        sent[name] = version
