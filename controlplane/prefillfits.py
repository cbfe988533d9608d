"""Overflow's prefill fits kept in etcd: a kvpilot started again, or another replica, goes on
from what was learned instead of counting a prefilled token at the constant for a minute.

The fit (``signals.prefillfit``) says what a prefilled token costs against an output token on
a route's owned engines; it lives in the reconciler's decisions and needs some eight busy
intervals of the owned replicas before it says anything. Each replica writes the fits of its
routes that can say their weight, and grew since its last write, to
``{prefix}/status/prefillfits/{route}`` at most once per ``FIT_WRITE_INTERVAL``, all in one
transaction, and once more when it stops. Every replica learns from the same telemetry, so
the last writer wins. A route whose fit is fresh continues from the stored one when it was
learned on the same owned pools at the same batch size (``signals.prefillrecord.seeded``).
Records carry no lease (they are meant to outlive the replica); one older than
``STORED_MAX_AGE`` is no longer taken and is deleted with the next batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import quote, unquote

from controlplane.etcd import KeyValue
from controlplane.etcd.batches import flush_every
from controlplane.etcd.keys import STATUS, decode_json, encode_json
from controlplane.etcd.store import Store
from controlplane.mirror import StateChange
from signals.overflow import OverflowDecision
from signals.prefillrecord import STORED_MAX_AGE, StoredFit, fit_record, restore

log = logging.getLogger(__name__)

FITS_PREFIX = f"{STATUS}/prefillfits/"
"""Relative key prefix of the stored fits, one per route."""
FIT_WRITE_INTERVAL = 30.0
"""Least seconds between two batches of fit writes of one replica: a fit moves by a few
intervals of 5 s in that time, and a replica that stops writes its last."""


def fit_key(route: str) -> str:
    """The relative key of a route's (``policy/route``) stored fit."""
    return f"{FITS_PREFIX}{quote(route, safe='')}"


class FitBoard:
    """The stored fits as etcd holds them, kept from the etcd mirror's changes."""

    def __init__(self) -> None:
        self.stored: dict[str, StoredFit] = {}
        """Route -> its stored fit."""

    def on_change(self, change: StateChange, items: Mapping[str, KeyValue]) -> None:
        """Follow the mirror: the fit records among the changed keys (every one after a
        re-list). A record that does not parse is left out and logged."""
        keys: Iterable[str] = items if change.full_resync else change.changed
        if change.full_resync:
            self.stored.clear()
        for key in keys:
            if not key.startswith(FITS_PREFIX):
                continue
            route = unquote(key[len(FITS_PREFIX) :])
            kv = items.get(key)
            body = decode_json(kv) if kv is not None else None
            stored = restore(body) if body is not None else None
            if stored is None:
                if kv is not None:
                    log.warning("stored prefill fit %s does not parse; not taken", key)
                self.stored.pop(route, None)
                continue
            self.stored[route] = stored

    def fits(self, now: float) -> Mapping[str, StoredFit]:
        """Route -> stored fit, a copy for one compile's state (``seeded`` judges age and
        scope)."""
        return dict(self.stored)


class FitPublisher:
    """Writes this replica's routes' fits that can say their weight to etcd, in batches."""

    def __init__(
        self,
        store: Store,
        board: FitBoard,
        decisions: Callable[[], Mapping[str, OverflowDecision]],
        replica_id: str,
        *,
        interval: float = FIT_WRITE_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.board = board
        self.decisions = decisions
        """The overflow decisions of the last compile (route -> decision)."""
        self.replica_id = replica_id
        self.interval = interval
        self.clock = clock
        self.writes = 0
        """etcd transactions written (one per batch)."""
        self._written: dict[str, tuple[int, int]] = {}
        """Route -> (intervals, screened) of the fit last written."""

    async def flush(self) -> None:
        """Write every fit that can say its weight, learned on a known scope, that this
        replica added to since its last write, and delete records past ``STORED_MAX_AGE``,
        in one transaction."""
        now = self.clock()
        puts: dict[str, bytes] = {}
        marks: dict[str, tuple[int, int]] = {}
        for route, decision in self.decisions().items():
            arrivals = decision.arrivals
            if arrivals is None or arrivals.scope is None:
                continue
            fit = arrivals.fit
            mark = (fit.intervals, fit.screened)
            if fit.stored or fit.weight() is None or self._written.get(route) == mark:
                continue
            puts[route] = encode_json(fit_record(fit, arrivals.scope, now, self.replica_id))
            marks[route] = mark
        stale = [
            route
            for route, stored in self.board.stored.items()
            if route not in puts and now - stored.at > STORED_MAX_AGE
        ]
        if not puts and not stale:
            return
        keys = self.store.keys
        await self.store.client.transact(
            [],
            puts=[(keys.absolute(fit_key(route)), body) for route, body in puts.items()],
            deletes=[keys.absolute(fit_key(route)) for route in stale],
        )
        self._written.update(marks)
        self.writes += 1

    async def run(self) -> None:
        """Publish every ``interval`` until cancelled; a cancelled publisher writes its last
        batch."""
        await flush_every(self.interval, self.flush, "prefill fits")


__all__ = ["FITS_PREFIX", "FIT_WRITE_INTERVAL", "FitBoard", "FitPublisher", "fit_key"]
