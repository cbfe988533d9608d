"""What both ADS protocol variants share: a stream's nonces, its status reporting, the
responses it plans, and the ordering rules between resource types."""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


class Stream:
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

    def plan(self, snapshot: Snapshot | None) -> list[Push]:
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
