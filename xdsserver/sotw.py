"""State of the world ADS: every response carries all of a type's resources the Envoy
subscribed to (xds_protocol, "Basic Protocol Overview")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2

from xdsserver.acceptance import Acceptance, Sent
from xdsserver.resources import (
    CLUSTER,
    PUSH_ORDER,
    REMOVE_ORDER,
    WILDCARD_TYPES,
    Resource,
    content_version,
)
from xdsserver.snapshot import Snapshot
from xdsserver.stream import (
    ANSWER_NEXT_REQUEST,
    LEADER,
    ROUTING_TYPES,
    WILDCARD,
    Push,
    Stream,
    in_order,
)


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
    acceptance: Acceptance[Resource] = field(default_factory=Acceptance)
    """What the Envoy runs: unions and partial pushes start from it; rejected versions held."""
    dirty: bool = True
    seen_version: str = ""
    partial: bool = False
    """The next response carries only the resources that changed since the last one."""


class SotwStream(Stream[_SotwType]):
    def handle(self, request: Any) -> None:
        type_url = self.request_type(request)
        if type_url is None:
            return
        st = self.types.get(type_url)
        if st is None:
            st = self.types[type_url] = _SotwType(type_url, client_version=request.version_info)
        nonce = str(request.response_nonce)
        if nonce:
            # Counted even on a stale nonce: it answers an earlier response of this stream.
            self.settle(st.acceptance, type_url, nonce, request)
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
            # Never answer a NACK with the same config (endless loop): settle() recorded the
            # version as rejected; the next different snapshot flows normally.
            return
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
        if not st.respond and st.acceptance.rejected(version):
            # A rejected version is not pushed again; a request that must be answered (new
            # names, a rebuilt cluster warming) still is.
            return None
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
                st.acceptance.accepted = dict(items)
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
        leader = self.types.get(LEADER.get(st.type_url, ""))
        return leader is not None and leader.sent is not None and not leader.nonce

    def plan(self, snapshot: Snapshot | None) -> list[Push]:
        held = self.routes_held()  # first: it also ends a hold that reached its limit
        if snapshot is None:
            return []
        added: set[str] = set()
        changes: list[tuple[_SotwType, dict[str, Resource]]] = []
        for type_url in in_order(self.types, PUSH_ORDER):
            st = self.types[type_url]
            if type_url in ROUTING_TYPES and (held or added):
                continue  # evaluated once the clusters warmed; their state waits untouched
            items = self._evaluate(st, snapshot)
            if items is None:
                continue
            if type_url == CLUSTER:
                if not _union_rejected(st, items):
                    added = items.keys() - st.acceptance.accepted.keys()
                elif held:
                    st.dirty = True  # the final set would drop what held routes may use
                    continue
                # (Once the Envoy rejected the union with these clusters, the final set goes
                # in the old make-before-break order: holding the routes would not help.)
            changes.append((st, items))
        held = held or bool(added)
        # A follower pushed in the round of its leader holds its whole named set: the leader's
        # rebuilt clusters (listeners) warm until theirs arrive, and Envoy's re-request for
        # them will carry a nonce that is stale by then.
        pushed = {st.type_url for st, _ in changes}
        for st, _ in changes:
            if LEADER.get(st.type_url) in pushed:
                st.partial = False
        # Make-before-break: when a full-set type (CDS/LDS) drops names the Envoy runs in a
        # round that also changes other types, first send the union (old kept), then the final
        # set after the rest, so nothing the new routes still reference disappears first. The
        # old side is what the Envoy accepted: what was merely sent may be what it rejected.
        # While routes are held, the final set of clusters waits for them (the union stands).
        first: list[tuple[_SotwType, dict[str, Resource], str]] = []
        last: list[tuple[_SotwType, dict[str, Resource], str]] = []
        for st, items in changes:
            final_version = snapshot.version(st.type_url)
            if not (st.wildcard and (len(changes) > 1 or held)):
                first.append((st, items, final_version))
                continue
            kept = _union(st, items)
            if kept is not None and not st.acceptance.rejected(kept[1]):
                union, union_version = kept
                if st.sent is None or not _same(union, st.sent):
                    first.append((st, union, union_version))  # not sent already
                if held:
                    st.dirty = True  # the final set goes out with the routes
                else:
                    last.append((st, items, final_version))
            else:
                first.append((st, items, final_version))
        rank = {t: i for i, t in enumerate(REMOVE_ORDER)}
        last.sort(key=lambda c: rank.get(c[0].type_url, len(rank)))
        pushes = []
        for i, (st, items, version) in enumerate(first + last):
            push = self._commit(st, items, version, makes=i < len(first))
            pushes.append(push)
            if st.type_url == CLUSTER and i < len(first):
                new = items.keys() - st.acceptance.accepted.keys()
                if new:
                    self.hold_routes(push.nonce, new)
        return pushes

    def _commit(
        self, st: _SotwType, items: dict[str, Resource], version: str, *, makes: bool
    ) -> Push:
        nonce = self.next_nonce()
        body = items
        if st.partial:
            # Only what the Envoy does not run yet: a response it rejected left it without.
            accepted = st.acceptance.accepted
            body = {n: r for n, r in items.items() if not _same_resource(accepted.get(n), r)}
            st.partial = False
        st.acceptance.sent(nonce, Sent(version, body, replace=st.wildcard))
        st.nonce, st.sent, st.sent_version = nonce, items, version
        follower = ANSWER_NEXT_REQUEST.get(st.type_url)
        if follower is not None and makes:
            self.types.setdefault(follower, _SotwType(follower)).respond_to_next_request = True
        # This response carries the whole named set (never partial while a re-request is owed
        # or in a round that pushed its leader), so that re-request is answered already.
        st.respond_to_next_request = False
        response = discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=st.type_url, nonce=nonce
        )
        response.resources.extend([r.body for r in body.values()])
        return Push(st.type_url, version, nonce, response)


def _union(st: _SotwType, items: Mapping[str, Resource]) -> tuple[dict[str, Resource], str] | None:
    """`items` with what the Envoy runs of a full-set type that `items` drops kept beside
    them, and that set's version; None when `items` drops nothing it runs."""
    accepted = st.acceptance.accepted
    dropped = accepted.keys() - items.keys()
    if not dropped:
        return None
    union = {n: accepted[n] for n in dropped} | dict(items)
    return union, content_version((n, r.version) for n, r in union.items())


def _union_rejected(st: _SotwType, items: Mapping[str, Resource]) -> bool:
    """Whether `items` drops names the Envoy runs and it rejected the union that keeps them."""
    kept = _union(st, items) if st.wildcard else None
    return kept is not None and st.acceptance.rejected(kept[1])


def _same(items: Mapping[str, Resource], sent: Mapping[str, Resource]) -> bool:
    if items.keys() != sent.keys():
        return False
    return all(_same_resource(sent[n], r) for n, r in items.items())


def _same_resource(old: Resource | None, new: Resource) -> bool:
    return old is not None and (old is new or old.version == new.version)
