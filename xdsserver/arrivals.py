"""Arrival rates per fleet and route, and service times per replica, from Envoy's upstream log.

The spill loop (``signals.spill``) needs, for a fleet with a locality, the rate at which its
Envoys start requests on a route and the rate its own locality can serve. Batch fill alone
shows a change only as the requests admitted before it finish. Envoy can say when a request
starts without Python in its path: the router's upstream log with
``upstream_log_options.flush_upstream_log_on_upstream_stream`` writes an entry
(``UpstreamPoolReady``) when an attempt gets its upstream stream, with the cluster and the
host already chosen, besides the usual entry when the attempt ends (``UpstreamEnd``). Both go
to kvpilot's access log service in batches (``SIGNALS_FLUSH_INTERVAL``), on the listeners of
fleets whose routes spill (``PlanListener.arrivals_log``).

From the start entries: first attempts per (fleet, route cluster) over the last
``ARRIVAL_WINDOW`` seconds (retries are not new demand). From the end entries of streamed
answers: the time from the replica's first byte to its last, per host, over the last
``SERVICE_WINDOW`` seconds: the time a request spends in the batch, without its wait in the
replica's queue (a full replica's queue would otherwise make its capacity look smaller). The
first byte is the first token; the prefill before it is left out, a small part of a request
with a few hundred tokens to generate.

Overflow that follows the route's arrival rate (``Overflow.signal: arrivals``,
``signals.overflowff``) reads the same log on its routes' listeners: the route's demand is
the first attempts on its own cluster (and its affinity twin) plus those on its overflow
aggregates and provider clusters (``route_demand``), whichever pool took them; the share of
its own starts that carried a session (the affinity twin's, ``session_rates``); and what its
replicas completed over the last few seconds (``completions`` with a shorter window).

The counts are this kvpilot replica's: a fleet whose Envoys are spread over several kvpilot
replicas is seen in part by each, and ``controlplane.arrivals`` adds the others' rates
through etcd.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from policies.names import LOCAL_SUFFIX
from signals.overflowff import OVERFLOW_PARTS, route_demand, route_of
from xdsserver.translate import AFFINITY_SUFFIX

ARRIVAL_WINDOW = 16.0
"""Seconds over which arrivals are counted: at 10 requests a second, 160 of them, a Poisson
count within about 8% of the rate (one standard deviation)."""
CHANGE_WINDOW = 4.0
"""The last seconds, compared with the long window: when their rate is further from it than
``CHANGE_SIGMAS`` standard deviations of their own count, the rate has changed (an overload
begins or ends) and the short window's rate is given, so the spill follows a change within
a few seconds and is steady otherwise."""
CHANGE_SIGMAS = 4.0
MIN_SPAN = 2.0
"""A key seen for less than this gives no rate yet: one entry in its first second is no
estimate."""
SERVICE_WINDOW = 30.0
"""Seconds over which service times are averaged per host."""
MIN_SERVICE = 0.05
"""Service times below this are not counted: an answer sent in one piece (not streamed) has
its first and last byte together, which says nothing of its time in the batch."""

_START = accesslog_pb2.AccessLogType.UpstreamPoolReady
_END = (accesslog_pb2.AccessLogType.UpstreamEnd, accesslog_pb2.AccessLogType.NotSet)


def route_cluster(cluster: str) -> str:
    """The route cluster an Envoy cluster belongs to (a hash twin, or its replicas part)."""
    # A capacity-bound route's twins are "/affinity-<factor>" (policy and route names hold
    # no "/", so everything from the suffix on is the twin's).
    head, found, _ = cluster.partition(AFFINITY_SUFFIX)
    return (head if found else cluster).removesuffix(LOCAL_SUFFIX)


def _seconds(value: Any) -> float:
    return float(value.seconds) + float(value.nanos) / 1e9


class ArrivalBook:
    """Request starts per (fleet, route cluster) and service times per host, over sliding
    windows; ``rates`` and ``service_times`` give what the next compile reads."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._starts: dict[str, deque[float]] = {}
        self._first: dict[str, float] = {}
        self._served: dict[str, deque[tuple[float, float]]] = {}
        self._done: dict[str, deque[float]] = {}
        self._done_first: dict[str, float] = {}
        self._sessions: dict[str, deque[float]] = {}
        self.entries = 0
        """Entries read (starts and ends)."""

    def observe(self, entry: Any, fleet: str) -> None:
        """One ``HTTPAccessLogEntry`` of an arrivals log, from an Envoy serving `fleet`."""
        self.entries += 1
        common = entry.common_properties
        cluster = route_cluster(common.upstream_cluster)
        if not cluster:
            return
        now = self.clock()
        if common.access_log_type == _START:
            if common.upstream_request_attempt_count > 1:
                return  # a retry: the same request again, not new demand
            key = f"{fleet}/{cluster}"
            self._starts.setdefault(key, deque()).append(now)
            self._first.setdefault(key, now)
            if cluster != common.upstream_cluster.removesuffix(LOCAL_SUFFIX):
                # The affinity twin's: a request with a session (overflow's conversations).
                self._sessions.setdefault(key, deque()).append(now)
            return
        if common.access_log_type not in _END:
            return
        socket = common.upstream_remote_address.socket_address
        if not socket.address or entry.response.response_code.value != 200:
            return
        host = f"{socket.address}:{socket.port_value}"
        self._done.setdefault(host, deque()).append(now)
        self._done_first.setdefault(host, now)
        if not (
            common.HasField("time_to_first_upstream_rx_byte")
            and common.HasField("time_to_last_upstream_rx_byte")
        ):
            return
        seconds = _seconds(common.time_to_last_upstream_rx_byte) - _seconds(
            common.time_to_first_upstream_rx_byte
        )
        if seconds >= MIN_SERVICE:
            self._served.setdefault(host, deque()).append((now, seconds))

    def rates(self, now: float | None = None) -> dict[str, float]:
        """``fleet/cluster`` -> requests started per second: over the last
        ``ARRIVAL_WINDOW`` (over the time since the first one, when that is shorter), or over
        the last ``CHANGE_WINDOW`` when that differs from it beyond noise."""
        now = self.clock() if now is None else now
        out: dict[str, float] = {}
        for key in list(self._starts):
            starts = self._starts[key]
            while starts and starts[0] <= now - ARRIVAL_WINDOW:
                starts.popleft()
            if not starts:
                del self._starts[key]
                self._first.pop(key, None)
                continue
            age = now - self._first[key]
            if age < MIN_SPAN:
                continue
            span = min(ARRIVAL_WINDOW, age)
            rate = len(starts) / span
            short_span = min(CHANGE_WINDOW, span)
            recent = sum(1 for at in starts if at > now - short_span)
            expected = rate * short_span
            if abs(recent - expected) > CHANGE_SIGMAS * math.sqrt(max(expected, 1.0)):
                rate = recent / short_span
            out[key] = round(rate, 4)
        return out

    def demand(self, route: str, now: float | None = None) -> float:
        """Requests per second this replica's Envoys started on `route` (``policy/route``),
        whichever pool took them: its own replicas, its overflow aggregates or its paid
        pools (``route_demand``)."""
        return route_demand(self.rates(now), route)

    def session_rates(self, now: float | None = None) -> dict[str, float]:
        """``fleet/cluster`` -> requests with a session (started on the route's affinity
        twin) per second over the last ``ARRIVAL_WINDOW``: with ``rates``, the share of a
        route's own starts that are conversations."""
        now = self.clock() if now is None else now
        out: dict[str, float] = {}
        for key in list(self._sessions):
            starts = self._sessions[key]
            while starts and starts[0] <= now - ARRIVAL_WINDOW:
                starts.popleft()
            first = self._first.get(key)
            if not starts or first is None:
                # (No start of the key within the window: ``rates`` has dropped it too.)
                if not starts:
                    del self._sessions[key]
                continue
            age = now - first
            if age >= MIN_SPAN:
                out[key] = round(len(starts) / min(ARRIVAL_WINDOW, age), 4)
        return out

    def recent_demands(self, now: float | None = None) -> dict[str, float]:
        """Route cluster (``policy/route``) -> requests per second this replica's Envoys
        started on the route (its own cluster, overflow aggregates and paid pools, every
        fleet) over the last ``CHANGE_WINDOW`` seconds alone: a rise shows here within
        seconds, where the shared rate averages it over ``ARRIVAL_WINDOW`` unless it is far
        beyond noise. Routes seen for less than ``CHANGE_WINDOW`` give none."""
        now = self.clock() if now is None else now
        self.rates(now)  # drops what left the window
        out: dict[str, float] = {}
        for key, starts in self._starts.items():
            if now - self._first.get(key, now) < CHANGE_WINDOW:
                continue
            _, _, cluster = key.partition("/")
            route = route_of(cluster)
            recent = sum(1 for at in starts if at > now - CHANGE_WINDOW)
            out[route] = round(out.get(route, 0.0) + recent / CHANGE_WINDOW, 4)
        return out

    def session_shares(self, now: float | None = None) -> dict[str, float]:
        """Route cluster (``policy/route``) -> the share of the requests this replica's
        Envoys started on the route's own replicas that had a session, every fleet
        together: what overflow's ``conversations: last`` needs to turn a share of the
        demand into shares of each kind (``signals.overflowff.kind_shares``)."""
        now = self.clock() if now is None else now
        sessions = self.session_rates(now)
        starts: dict[str, float] = {}
        with_session: dict[str, float] = {}
        for key, rate in self.rates(now).items():
            _, _, cluster = key.partition("/")
            starts[cluster] = starts.get(cluster, 0.0) + rate
            with_session[cluster] = with_session.get(cluster, 0.0) + sessions.get(key, 0.0)
        return {
            cluster: round(min(1.0, with_session[cluster] / rate), 4)
            for cluster, rate in starts.items()
            if rate > 0
        }

    def completions(
        self, now: float | None = None, window: float = ARRIVAL_WINDOW
    ) -> dict[str, float]:
        """``address:port`` -> answers completed there per second (200, from any fleet)
        over the last `window` seconds (at most ``ARRIVAL_WINDOW``): while its replicas are
        full, a locality's completion rate is its capacity, whatever its byte timings say."""
        now = self.clock() if now is None else now
        window = min(window, ARRIVAL_WINDOW)
        out: dict[str, float] = {}
        for host in list(self._done):
            done = self._done[host]
            while done and done[0] <= now - ARRIVAL_WINDOW:
                done.popleft()
            if not done:
                del self._done[host]
                self._done_first.pop(host, None)
                continue
            age = now - self._done_first[host]
            if age >= MIN_SPAN:
                count = sum(1 for at in done if at > now - window)
                out[host] = round(count / min(window, age), 4)
        return out

    def service_times(self, now: float | None = None) -> dict[str, float]:
        """``address:port`` -> mean seconds from first to last byte of the streamed answers
        that ended there over the last ``SERVICE_WINDOW``."""
        now = self.clock() if now is None else now
        out: dict[str, float] = {}
        for host in list(self._served):
            served = self._served[host]
            while served and served[0][0] <= now - SERVICE_WINDOW:
                served.popleft()
            if not served:
                del self._served[host]
                continue
            out[host] = round(sum(s for _, s in served) / len(served), 4)
        return out


__all__ = [
    "ARRIVAL_WINDOW",
    "CHANGE_WINDOW",
    "MIN_SERVICE",
    "OVERFLOW_PARTS",
    "SERVICE_WINDOW",
    "ArrivalBook",
    "route_cluster",
    "route_demand",
    "route_of",
]
