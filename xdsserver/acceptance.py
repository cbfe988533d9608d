"""What an Envoy has accepted, per resource type on one ADS stream: the rule both protocols use.

An Envoy answers every response in order, echoing its nonce: an ACK, or a NACK (a request with
`error_detail`) after which it keeps running what it had. So what it runs is the content of the
responses it ACKed, never simply what was sent last. Everything computed for it (make-before-
break unions, SotW partial pushes, Delta updates) starts from `Acceptance.accepted`, and a
version it rejected is not sent to it again (design.md, "xDS server rules" 3).

The answer to an older response can arrive after a newer one went out: a make-before-break round
sends two responses of one type back to back. Its nonce is stale for the subscription rules
(SotW ignores such a request), but the ACK or NACK it carries is still counted here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

_REJECTED_KEPT = 64
"""Rejected versions remembered per type and stream (content hashes; oldest forgotten first)."""


@dataclass(frozen=True, slots=True)
class Sent(Generic[V]):
    """One response as the stream sent it, until the Envoy answers it."""

    version: str
    updates: Mapping[str, V]
    removals: tuple[str, ...] = ()
    replace: bool = False
    """A SotW full-set response (CDS, LDS): the names it leaves out are gone once accepted."""


@dataclass(frozen=True, slots=True)
class Answer(Generic[V]):
    sent: Sent[V]
    nacked: bool


class Acceptance(Generic[V]):
    """Responses in flight and what the Envoy accepted of one type (name → V).

    SotW keeps `Resource` values (a union re-sends the accepted resources themselves); Delta
    keeps resource versions, which is also what an Envoy reports on reconnect.
    """

    __slots__ = ("_pending", "_rejected", "accepted")

    def __init__(self, accepted: Mapping[str, V] | None = None) -> None:
        self.accepted: dict[str, V] = dict(accepted or {})
        self._pending: dict[str, Sent[V]] = {}
        self._rejected: dict[str, None] = {}  # an ordered set

    def sent(self, nonce: str, sent: Sent[V]) -> None:
        self._pending[nonce] = sent

    def answer(self, nonce: str, *, nacked: bool) -> Answer[V] | None:
        """Apply the Envoy's answer to the response sent with `nonce`.

        None when that nonce is not awaiting an answer (already answered: a later request that
        repeats it only changes subscriptions; or never sent on this stream).
        """
        sent = self._pending.get(nonce)
        if sent is None:
            return None
        # Answers come in order: responses before this one that were not answered never will be.
        for older in list(self._pending):
            del self._pending[older]
            if older == nonce:
                break
        if nacked:
            self._rejected[sent.version] = None
            while len(self._rejected) > _REJECTED_KEPT:
                del self._rejected[next(iter(self._rejected))]
        else:
            if sent.replace:
                self.accepted = dict(sent.updates)
            else:
                self.accepted.update(sent.updates)
            for name in sent.removals:
                self.accepted.pop(name, None)
        return Answer(sent, nacked)

    def awaiting(self, nonce: str) -> bool:
        """Whether the response sent with `nonce` has not been answered yet."""
        return nonce in self._pending

    def rejected(self, version: str) -> bool:
        """Whether the Envoy rejected this version on this stream."""
        return version in self._rejected
