"""What both ADS protocol variants share: a stream's nonces, its status reporting, the
responses it plans, and the ordering rules between resource types.

Routes wait for the clusters they may reference. Envoy takes a cluster that CDS adds into
use only when it finished warming: its ClusterLoadAssignment arrived and, with active health
checks, the first check of each endpoint completed. A listener or route goes live as soon as it
arrives, so a route pushed right behind its new cluster answers ``503`` with the flag ``NC``
for those milliseconds. Envoy holds back its ACK of a CDS response while any cluster warms
(after its own start-up; its cluster manager says this is meant as the signal for an ADS
server), so after a CDS response that adds clusters a stream sends no LDS or RDS change until
that response is answered, for at most `WARMING_HOLD_SECONDS`.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from xdsserver.acceptance import Acceptance, Answer
from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, short_name
from xdsserver.snapshot import Snapshot
from xdsserver.status import ConnectionRegistry, ConnectionStatus

log = logging.getLogger(__name__)

WILDCARD = "*"

# After a cluster (listener) update Envoy re-requests the endpoints (routes) of the clusters
# (listeners) it rebuilt, often with an unchanged name set; a rebuilt cluster only finishes
# warming when its ClusterLoadAssignment arrives, so that request must be answered.
ANSWER_NEXT_REQUEST = {CLUSTER: ENDPOINT, LISTENER: ROUTE}
LEADER = {follower: leader for leader, follower in ANSWER_NEXT_REQUEST.items()}

ROUTING_TYPES = frozenset({LISTENER, ROUTE})
"""What may name a cluster: held while clusters the Envoy was just sent are warming."""

WARMING_HOLD_SECONDS = 10.0
"""The longest routes wait for a CDS ACK. Warming takes a round trip plus the first health
check (its timeout is 1 s by default), or a DNS lookup for a provider's cluster; an Envoy that
never answers must not keep every later route change from its fleet."""


def in_order(types: Iterable[str], order: tuple[str, ...]) -> list[str]:
    """`types` sorted by their place in `order` (PUSH_ORDER, REMOVE_ORDER), unknown ones last."""
    rank = {t: i for i, t in enumerate(order)}
    return sorted(types, key=lambda t: (rank.get(t, len(order)), t))


@dataclass(slots=True)
class Push:
    """One response a stream sends, with what status reporting needs to know about it."""

    type_url: str
    version: str
    nonce: str
    response: Any


@dataclass(slots=True)
class Warming:
    """Clusters added by CDS responses the Envoy has not answered yet."""

    nonce: str
    """The latest such response: its answer (or a later one's) ends the hold."""
    clusters: frozenset[str]
    since: float
    """`time.monotonic()` of the first response: the hold's limit counts from it."""


T = TypeVar("T")
"""A protocol variant's state of one resource type."""


class Stream(Generic[T]):
    """State shared by both protocol variants: per-type state, nonces, status reporting,
    completion, and the hold of routes while new clusters warm."""

    def __init__(
        self,
        conn: ConnectionStatus,
        status: ConnectionRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self.status = status
        self.types: dict[str, T] = {}
        self.done = False
        self.warming: Warming | None = None
        self._clock = clock
        self._nonce_prefix = secrets.token_hex(4)
        self._nonce_counter = itertools.count(1)

    def next_nonce(self) -> str:
        return f"{self._nonce_prefix}-{next(self._nonce_counter)}"

    def handle(self, request: Any) -> None:
        raise NotImplementedError

    def plan(self, snapshot: Snapshot | None) -> list[Push]:
        """Responses to send now, in order, with the stream state already updated for them."""
        raise NotImplementedError

    def routes_held(self) -> bool:
        """Whether LDS and RDS changes wait for clusters to warm (ends the hold at its limit)."""
        warming = self.warming
        if warming is None:
            return False
        waited = self._clock() - warming.since
        if waited < WARMING_HOLD_SECONDS:
            return True
        log.warning(
            "xDS node=%s fleet=%s has not answered the CDS response adding %s after %.0f s; "
            "sending routes now (a route to a cluster still warming answers 503 NC)",
            self.conn.node_id,
            self.conn.fleet,
            ", ".join(sorted(warming.clusters)),
            waited,
        )
        self._end_warming(waited, timed_out=True)
        return False

    def hold_routes(self, nonce: str, added: Iterable[str]) -> None:
        """A CDS response sent with `nonce` adds `added`: routes wait for its answer."""
        clusters = frozenset(added)
        if self.warming is None:
            self.warming = Warming(nonce, clusters, self._clock())
        else:
            self.warming.nonce = nonce
            self.warming.clusters |= clusters
        self.status.warming(self.conn, self.warming.clusters)

    def wake_in(self) -> float | None:
        """Seconds until the stream must plan again without a request or snapshot (the
        limit of a hold), or None."""
        if self.warming is None:
            return None
        return max(0.0, self.warming.since + WARMING_HOLD_SECONDS - self._clock())

    def _cluster_answered(self, acceptance: Acceptance[Any]) -> None:
        warming = self.warming
        if warming is None or acceptance.awaiting(warming.nonce):
            return
        waited = self._clock() - warming.since
        log.debug(
            "xDS node=%s warmed %d cluster(s) in %.3f s",
            self.conn.node_id,
            len(warming.clusters),
            waited,
        )
        self._end_warming(waited, timed_out=False)

    def _end_warming(self, waited: float, *, timed_out: bool) -> None:
        self.warming = None
        self.status.warmed(self.conn, seconds=waited, timed_out=timed_out)

    def request_type(self, request: Any) -> str | None:
        """The request's type URL; None (logged) for a request without one, which is ignored."""
        type_url = str(request.type_url)
        if not type_url:
            log.warning("xDS request without type_url from node=%s ignored", self.conn.node_id)
            return None
        return type_url

    def log_stale(self, type_url: str) -> None:
        log.debug("xDS stale nonce node=%s type=%s", self.conn.node_id, short_name(type_url))

    def settle(
        self, acceptance: Acceptance[Any], type_url: str, nonce: str, request: Any
    ) -> Answer[Any] | None:
        """Apply the ACK or NACK a request carries for the response sent with `nonce`, and
        report it; None if that response was answered already (or never sent here)."""
        answer = acceptance.answer(nonce, nacked=request.HasField("error_detail"))
        if answer is None:
            return None
        if answer.nacked:
            self.record_nack(type_url, answer.sent.version, request)
        else:
            self.status.acked(self.conn, type_url, version=answer.sent.version)
        if type_url == CLUSTER:
            # An ACK says the clusters warmed; after a NACK the Envoy has none of them, and
            # holding the routes longer would not change that.
            self._cluster_answered(acceptance)
        return answer

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
