"""The work each response took its replica, from the usage Envoy's listeners log: overflow
by arrivals' unit (``signals.overflowff``, "Capacity and demand in one unit of work").

Every kvpilot listener's connection manager logs each response's OpenAI ``usage`` (the
accounting filter's counts, ``xdsserver.translate.usage``) to kvpilot, where
``xdsserver.usage.UsageBook`` prices it. The same entries name the upstream host that served
the request's last attempt and the route entry that took it (``policy/route#0/affinity``
for a request with the route's session header, ``policy/route#0`` or ``.../prefix`` for
one without, ``/overflow`` when it went to a paid pool's aggregate). From them:

- per host, the tokens its responses carried (output, and uncached prompt tokens: their
  work is ``signals.overflowwork.Work``, weighed when the decision is made with the
  weight ``signals.prefillfit`` learns) per second, over the last seconds and over
  ``ARRIVAL_WINDOW``, and the prefill per completion token (what turns the engine's output
  tokens a second, from its telemetry, into the work it computes: the capacity while full);
- per route, its responses over ``ARRIVAL_WINDOW`` by kind (with or without a session),
  whichever pool served them, and their tokens: the demand's mean work per request.

An entry arrives when its response ends (``USAGE_FLUSH_INTERVAL`` later), so these count
completions, not arrivals. The counts are this kvpilot replica's Envoys'.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from signals.overflowwork import KindWork, Work
from xdsserver.arrivals import ARRIVAL_WINDOW, MIN_SPAN
from xdsserver.translate.usage import USAGE_FILTER
from xdsserver.usage import parse_route_name

SESSION_ENTRY = "/affinity"
"""In a route entry's name after ``#``: the entry that matches the session header
(``xdsserver.translate.routes``), its overflow entry included."""


def entry_kind(route_name: str) -> tuple[str, bool]:
    """(route cluster ``policy/route``, whether the request had a session) from a route
    entry's name."""
    route, _ = parse_route_name(route_name)
    _, _, rest = route_name.partition("#")
    return route, SESSION_ENTRY in rest


def _expire(entries: deque[Any], now: float) -> int:
    """Drop `entries` (oldest first, their time first) older than ``ARRIVAL_WINDOW``; how
    many are left. Each entry is dropped once: the windows stay bounded whether or not
    anything reads them (the reconciler reads them only for overflow by arrivals)."""
    while entries and entries[0][0] <= now - ARRIVAL_WINDOW:
        entries.popleft()
    return len(entries)


class WorkBook:
    """Tokens per host and per route and kind over sliding windows, from usage entries."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._hosts: dict[str, deque[tuple[float, float, float]]] = {}
        """Host -> (when, completion tokens, uncached prompt tokens) of each response."""
        self._host_first: dict[str, float] = {}
        self._routes: dict[str, deque[tuple[float, bool, float, float]]] = {}
        """Route -> (when, with a session, completion tokens, uncached prompt tokens)."""
        self.entries = 0
        """Entries with usage counted."""

    def observe(self, entry: Any) -> None:
        """One ``HTTPAccessLogEntry`` of a usage log (``kvpilot.usage/<listener>``)."""
        common = entry.common_properties
        fields = common.metadata.filter_metadata.get(USAGE_FILTER)
        if fields is None or "prompt" not in fields.fields:
            return
        if entry.response.response_code.value != 200:
            return
        values = fields.fields
        tokens = Work.of(
            int(values["prompt"].number_value),
            int(values["cached"].number_value) if "cached" in values else 0,
            int(values["completion"].number_value) if "completion" in values else 0,
        )
        now = self.clock()
        self.entries += 1
        route, session = entry_kind(common.route_name)
        if route:
            seen = self._routes.setdefault(route, deque())
            seen.append((now, session, *tokens))
            _expire(seen, now)
        socket = common.upstream_remote_address.socket_address
        if socket.address:
            host = f"{socket.address}:{socket.port_value}"
            done = self._hosts.setdefault(host, deque())
            done.append((now, *tokens))
            _expire(done, now)
            self._host_first.setdefault(host, now)

    @property
    def held(self) -> int:
        """Entries held in the windows (per host and per route): at most what
        ``ARRIVAL_WINDOW`` saw, read or not."""
        return sum(map(len, self._hosts.values())) + sum(map(len, self._routes.values()))

    def _drop_old(self, now: float) -> None:
        for host in list(self._hosts):
            if not _expire(self._hosts[host], now):
                del self._hosts[host]
                self._host_first.pop(host, None)
        for route in list(self._routes):
            if not _expire(self._routes[route], now):
                del self._routes[route]

    def host_work(
        self, now: float | None = None, window: float = ARRIVAL_WINDOW
    ) -> dict[str, Work]:
        """``address:port`` -> the tokens its responses carried per second over the last
        `window` seconds (at most ``ARRIVAL_WINDOW``; over the time since its first one when
        that is shorter, and none before ``MIN_SPAN``)."""
        now = self.clock() if now is None else now
        window = min(window, ARRIVAL_WINDOW)
        self._drop_old(now)
        out: dict[str, Work] = {}
        for host, done in self._hosts.items():
            age = now - self._host_first[host]
            if age < MIN_SPAN:
                continue
            span = min(window, age)
            output = sum(c for at, c, _ in done if at > now - window)
            prefill = sum(p for at, _, p in done if at > now - window)
            out[host] = Work(round(output / span, 4), round(prefill / span, 4))
        return out

    def prefill_per_output(self, now: float | None = None) -> dict[str, float]:
        """``address:port`` -> the uncached prompt tokens of its responses over
        ``ARRIVAL_WINDOW`` per completion token: with the engine's output tokens a second
        and the weight, the work it computes (``1 + weight x this`` per output token)."""
        now = self.clock() if now is None else now
        self._drop_old(now)
        out: dict[str, float] = {}
        for host, done in self._hosts.items():
            tokens = sum(c for _, c, _ in done)
            if tokens > 0:
                out[host] = round(sum(p for _, _, p in done) / tokens, 4)
        return out

    def kinds(self, now: float | None = None) -> dict[str, KindWork]:
        """Route cluster -> its responses over ``ARRIVAL_WINDOW`` by kind and their tokens."""
        now = self.clock() if now is None else now
        self._drop_old(now)
        out: dict[str, KindWork] = {}
        for route, seen in self._routes.items():
            plain = [(c, p) for _, session, c, p in seen if not session]
            sessions = [(c, p) for _, session, c, p in seen if session]
            out[route] = KindWork(
                plain=len(plain),
                plain_output=float(sum(c for c, _ in plain)),
                plain_prefill=float(sum(p for _, p in plain)),
                sessions=len(sessions),
                session_output=float(sum(c for c, _ in sessions)),
                session_prefill=float(sum(p for _, p in sessions)),
            )
        return out


__all__ = ["SESSION_ENTRY", "WorkBook", "entry_kind"]
