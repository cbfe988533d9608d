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
``ARRIVAL_WINDOW`` seconds, or over the time since the route's rate last changed beyond
noise (``change_point_rate``, found on the starts of a route's clusters together: its own,
its overflow aggregates', its paid pools'; retries are not new demand). From the end
entries of streamed answers: the time from the replica's first byte to its last, per host,
over the last ``SERVICE_WINDOW`` seconds. The first byte is the first token where the replica queues
before it answers; the prefill before it is left out, a small part of a request with a few
hundred tokens to generate.

A server that sends its answer's headers before the request gets a batch slot (the
simulator, and any server that starts its stream at once) has its queue wait inside that
time, and a queueing locality's capacity (slots over service time) then looks smaller than
it is, so it spills more than its excess. With the hosts' batch slots (``slots``: the agents'
``max_running``), the book counts the attempts in flight per host (each end entry matched to
its start by the request's start time and attempt number) and takes service times only from
attempts that started while their host had a free slot: those went into the batch at once.
Without a host's slots every streamed answer counts, as before.

Overflow that follows the route's arrival rate (``Overflow.signal: arrivals``,
``signals.overflowff``) reads the same log on its routes' listeners: the route's demand is
the first attempts on its own cluster (and its affinity twin) plus those on its overflow
aggregates and provider clusters (``signals.overflowff.route_demand`` of ``rates``),
whichever pool took them; the share of its own starts that carried a session (the affinity
twin's, ``session_rates``); and what its replicas completed over the last few seconds
(``completions`` with a shorter window).

The counts are this kvpilot replica's: a fleet whose Envoys are spread over several kvpilot
replicas is seen in part by each, and ``controlplane.arrivals`` adds the others' rates
through etcd.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from policies.names import LOCAL_SUFFIX
from signals.overflowdemand import route_of
from xdsserver.translate import AFFINITY_SUFFIX

ARRIVAL_WINDOW = 16.0
"""Seconds over which arrivals are counted: at 10 requests a second, 160 of them, a Poisson
count within about 8% of the rate (one standard deviation)."""
CHANGE_WINDOW = 4.0
"""The last seconds, compared with the seconds before them in the long window (or since the
last change point): when their rates differ by more than ``CHANGE_SIGMAS`` standard
deviations of that difference, the rate changed (an overload begins or ends) at the start of
these seconds, and the rate is counted from there on (``change_point_rate``)."""
CHANGE_SIGMAS = 3.0
"""At 3, a doubling (5.5 to 11 a second) is found in a median 3.5 s, and a steady 10 a
second raises a false change about 11 times an hour (each gives a 4 s rate for a moment that
grows back to 16 s); at 4, the doubling is missed half of the time and the rate follows it
over the whole long window."""
HOLD_SIGMAS = 2.0
"""A change point is kept while the rates before and after it still differ by this many
standard deviations: a burst taken for a change (the rate after it regresses to the one
before) is undone within seconds, where a real change only grows more certain."""
MIN_BEFORE = CHANGE_WINDOW / 2
"""Seconds before the last ``CHANGE_WINDOW`` needed to compare them with: right after a
change point there is nothing to compare against yet."""
MIN_SPAN = 2.0
"""A key seen for less than this gives no rate yet: one entry in its first second is no
estimate."""
SERVICE_WINDOW = 30.0
"""Seconds over which service times are averaged per host."""
SERVICE_HOLD = 120.0
"""Seconds a host's last service time stands when none came since: a host whose batch stays
full gives none (every attempt started without a free slot), and that is when its
locality's capacity is needed. Feed-forward holds a locality at ``signals.spill.LOAD`` of
its capacity, so it is full most of a long overload: without the hold, its capacity went
unknown 30 s in and the fill loop took over (8 points more crossed at seed 2 of the regions
benchmark's 80 s overload)."""
MIN_SERVICE = 0.05
"""Service times below this are not counted: an answer sent in one piece (not streamed) has
its first and last byte together, which says nothing of its time in the batch."""

PENDING_LIMIT = 600.0
"""Seconds an attempt's start waits for its end entry: one lost (an Envoy that stopped) no
longer counts in flight after that."""
SLOTS_REFRESH = 1.0
"""Seconds between two reads of the hosts' batch slots (``slots``)."""

_START = accesslog_pb2.AccessLogType.UpstreamPoolReady
_END = (accesslog_pb2.AccessLogType.UpstreamEnd, accesslog_pb2.AccessLogType.NotSet)


def route_cluster(cluster: str) -> str:
    """The route cluster an Envoy cluster belongs to (a hash twin, or its replicas part)."""
    # A capacity-bound route's twins are "/affinity-<factor>" (policy and route names hold
    # no "/", so everything from the suffix on is the twin's).
    head, found, _ = cluster.partition(AFFINITY_SUFFIX)
    return (head if found else cluster).removesuffix(LOCAL_SUFFIX)


def route_key(key: str) -> str:
    """The ``fleet/route`` a ``fleet/cluster`` key's starts count toward: the route cluster
    of an overflow aggregate or a paid pool's cluster (``route_of``), else the cluster."""
    fleet, _, cluster = key.partition("/")
    return f"{fleet}/{route_of(cluster)}"


def change_point_rate(
    starts: Sequence[float], now: float, since: float, change: float | None
) -> tuple[float, float | None]:
    """Requests per second from their start times, and the change point to keep for the next
    call: counted since `since` (the long window's start, or the first start when that is
    later) or since `change`, the last change point, when that is later. Its
    ``CHANGE_WINDOW`` last seconds are compared with the seconds before them: a difference
    beyond ``CHANGE_SIGMAS`` standard deviations (of the two rates' difference, at their
    pooled rate) makes the start of those seconds the change point, kept while the rates
    before and after it differ by ``HOLD_SIGMAS`` (a burst taken for a change is undone as
    the rate after it falls back to the one before). So right after a change
    the rate is over ``CHANGE_WINDOW`` seconds, then over the time since the change as it
    grows, its noise falling with the evidence, until the long window holds only what
    followed the change; and a steady rate is the long window's. `starts` are ascending and
    none is older than the long window; `change` None: none held."""
    if change is not None and change <= since:
        change = None  # the window now holds only what followed it
    if change is not None and change - since >= MIN_BEFORE and now > change:
        older = sum(1 for at in starts if at < change)
        apart = _sigmas_apart(older, change - since, len(starts) - older, now - change)
        if apart < HOLD_SIGMAS:
            change = None  # the rates on either side agree again: it was a burst
    base = since if change is None else change
    cut = now - CHANGE_WINDOW
    before = cut - base
    if before >= MIN_BEFORE:
        older = sum(1 for at in starts if base <= at <= cut)
        recent = sum(1 for at in starts if at > cut)
        if _sigmas_apart(older, before, recent, CHANGE_WINDOW) > CHANGE_SIGMAS:
            change = base = cut
    count = sum(1 for at in starts if at >= base)
    return count / (now - base), change


def _sigmas_apart(older: int, ahead: float, newer: int, behind: float) -> float:
    """How many standard deviations apart two Poisson rates are: `older` starts over `ahead`
    seconds against `newer` over the `behind` seconds that followed, the deviation of their
    difference taken at their pooled rate (at least one start over both spans)."""
    pooled = max(older + newer, 1) / (ahead + behind)
    spread = math.sqrt(pooled * (1.0 / ahead + 1.0 / behind))
    return abs(newer / behind - older / ahead) / spread


def _seconds(value: Any) -> float:
    return float(value.seconds) + float(value.nanos) / 1e9


class ArrivalBook:
    """Request starts per (fleet, route cluster) and service times per host, over sliding
    windows; ``rates`` and ``service_times`` give what the next compile reads."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        slots: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.clock = clock
        self.slots = slots
        """``address:port`` -> batch slots (``max_running``); None: not known."""
        self._slots: Mapping[str, int] = {}
        self._slots_at = -math.inf
        self._in_flight: dict[str, int] = {}
        """``address:port`` -> attempts started there whose end has not come."""
        self._pending: dict[tuple[str, bytes, int], tuple[float, bool]] = {}
        """(host, request start, attempt) -> (when it started, whether its time counts: not when
        its host had no free slot)."""
        self.free_starts = 0
        """Attempts that started while their host had a free slot (service times taken)."""
        self.queued_starts = 0
        """Attempts that started while their host's slots were all taken (not timed)."""
        self._starts: dict[str, deque[float]] = {}
        self._first: dict[str, float] = {}
        self._change: dict[str, float] = {}
        """``fleet/route`` (``route_key``) -> its last change point (``change_point_rate``),
        while the long window still holds starts from before it."""
        self._served: dict[str, deque[tuple[float, float]]] = {}
        self._last_service: dict[str, tuple[float, float]] = {}
        """``address:port`` -> (when its last service time was taken, the mean then)."""
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
        socket = common.upstream_remote_address.socket_address
        host = f"{socket.address}:{socket.port_value}" if socket.address else ""
        attempt = (
            host,
            common.start_time.SerializeToString() if common.HasField("start_time") else b"",
            common.upstream_request_attempt_count,
        )
        if common.access_log_type == _START:
            if host:
                self._start_attempt(attempt, now)
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
        free = self._end_attempt(attempt) if host else None
        if not host or entry.response.response_code.value != 200:
            return
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
        # An attempt that waited for a slot has that wait in its time: left out (None: its
        # start was not seen or the host's slots are unknown, so it counts as before).
        if seconds >= MIN_SERVICE and free is not False:
            self._served.setdefault(host, deque()).append((now, seconds))

    def _host_slots(self, now: float) -> Mapping[str, int]:
        if self.slots is not None and now - self._slots_at >= SLOTS_REFRESH:
            self._slots, self._slots_at = self.slots(), now
        return self._slots

    def _start_attempt(self, attempt: tuple[str, bytes, int], now: float) -> None:
        """Count an attempt in flight on its host, noting whether the host had a free slot."""
        host = attempt[0]
        if self._pending and len(self._pending) % 256 == 0:
            self._expire(now)
        slots = self._host_slots(now).get(host)
        running = self._in_flight.get(host, 0)
        free: bool | None = None if not slots else running < slots
        if free is True:
            self.free_starts += 1
        elif free is False:
            self.queued_starts += 1
        if attempt in self._pending:
            return  # the same start twice (a resent batch): counted once
        self._pending[attempt] = (now, free is not False)
        self._in_flight[host] = running + 1

    def _end_attempt(self, attempt: tuple[str, bytes, int]) -> bool | None:
        """The attempt is no longer in flight; whether it started with a free slot (None: its
        start was not seen)."""
        started = self._pending.pop(attempt, None)
        if started is None:
            return None
        host = attempt[0]
        left = self._in_flight.get(host, 0) - 1
        if left > 0:
            self._in_flight[host] = left
        else:
            self._in_flight.pop(host, None)
        return started[1]

    def _expire(self, now: float) -> None:
        for attempt, (at, _) in list(self._pending.items()):
            if at < now - PENDING_LIMIT:
                self._end_attempt(attempt)

    def in_flight(self) -> dict[str, int]:
        """``address:port`` -> attempts started there whose end has not come (as this
        replica's Envoys report them)."""
        self._expire(self.clock())
        return dict(self._in_flight)

    def rates(self, now: float | None = None) -> dict[str, float]:
        """``fleet/cluster`` -> requests started per second: over the last
        ``ARRIVAL_WINDOW`` (over the time since the first one, when that is shorter), or,
        after a change of rate, over the time since the change (``change_point_rate``).

        The change is found on a route's starts together, its own cluster's, its overflow
        aggregates' and its paid pools' (``route_of``), and each cluster's rate is its starts
        since the route's change over the same time: so the clusters of a route add up to
        its demand whichever way overflow splits it. Found cluster by cluster, a new paid
        share moved starts from one cluster to another, each found its own change (or none,
        or a new cluster gave no rate for its first seconds), and the route's demand dipped
        by a third for a round as the split moved at a peak."""
        now = self.clock() if now is None else now
        routes: dict[str, list[str]] = {}
        for key in list(self._starts):
            starts = self._starts[key]
            while starts and starts[0] <= now - ARRIVAL_WINDOW:
                starts.popleft()
            if not starts:
                del self._starts[key]
                self._first.pop(key, None)
                continue
            routes.setdefault(route_key(key), []).append(key)
        for route in [route for route in self._change if route not in routes]:
            del self._change[route]
        out: dict[str, float] = {}
        for route, keys in routes.items():
            age = now - min(self._first[key] for key in keys)
            if age < MIN_SPAN:
                continue
            since = now - min(ARRIVAL_WINDOW, age)
            # A route with one cluster (no overflow, a located fleet's) needs no merge.
            merged: Sequence[float] = (
                self._starts[keys[0]]
                if len(keys) == 1
                else list(heapq.merge(*(self._starts[key] for key in keys)))
            )
            rate, change = change_point_rate(merged, now, since, self._change.get(route))
            if change is None:
                self._change.pop(route, None)
            else:
                self._change[route] = change
            if len(keys) == 1:
                out[keys[0]] = round(rate, 4)
                continue
            base = since if change is None else change
            for key in keys:
                count = sum(1 for at in self._starts[key] if at >= base)
                out[key] = round(count / (now - base), 4)
        return out

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
        first: dict[str, float] = {}
        for key in self._starts:
            _, _, cluster = key.partition("/")
            route = route_of(cluster)
            first[route] = min(first.get(route, now), self._first.get(key, now))
        out: dict[str, float] = {}
        for key, starts in self._starts.items():
            _, _, cluster = key.partition("/")
            route = route_of(cluster)
            if now - first[route] < CHANGE_WINDOW:
                continue
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
        that ended there over the last ``SERVICE_WINDOW``; for a host with none there, the
        last such mean, until ``SERVICE_HOLD`` seconds after its last answer counted."""
        now = self.clock() if now is None else now
        for host in list(self._served):
            served = self._served[host]
            last = served[-1][0] if served else now
            while served and served[0][0] <= now - SERVICE_WINDOW:
                served.popleft()
            if served:
                self._last_service[host] = (last, round(sum(s for _, s in served) / len(served), 4))
            else:
                del self._served[host]
        out: dict[str, float] = {}
        for host, (at, mean) in list(self._last_service.items()):
            if now - at > SERVICE_HOLD:
                del self._last_service[host]
            else:
                out[host] = mean
        return out


__all__ = [
    "ARRIVAL_WINDOW",
    "CHANGE_SIGMAS",
    "CHANGE_WINDOW",
    "HOLD_SIGMAS",
    "MIN_SERVICE",
    "PENDING_LIMIT",
    "SERVICE_HOLD",
    "SERVICE_WINDOW",
    "ArrivalBook",
    "change_point_rate",
    "route_cluster",
    "route_key",
]
