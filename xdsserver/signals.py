"""Data-plane signals: Envoy's gRPC access log service (ALS), per pool, with no Prometheus.

Why ALS, and not load reports (LRS) or the metrics service:

- A rollout's analysis needs, for each pool of a route, its status codes and its time to first
  byte (time to first token for a streamed completion), over exactly the time of one step.
- The pools of a rollout share one Envoy cluster (endpoint weights keep session affinity across
  the split, README "rollout split"), so the numbers must be per upstream host, then summed per
  pool.
- LRS (``envoy.service.load_stats.v3``) reports per host only counts of successful, errored and
  in-flight requests; it carries no latency at all.
- The metrics service (``envoy.service.metrics.v3``) pushes Envoy's stats, whose latency
  histograms (``upstream_rq_time``) and status counters exist per cluster, not per host: the
  canary and the stable pool would be one number.
- ALS sends one entry per request with the upstream cluster and host, the response code and
  the timings of the upstream exchange. Configured as the router's *upstream* log it sends one
  entry per attempt, so a canary's 500 that a retry hid from the client still counts against
  the canary, and time to first byte is the attempt's own.

kvpilot turns the upstream log on only on listeners whose routes a Rollout watches
(``PlanListener.upstream_signals``), so Envoys send nothing for the rest of the traffic. Envoy
buffers entries and sends them in batches (``SIGNALS_FLUSH_INTERVAL``); parsing one entry costs
microseconds. Entries are folded into per-pool counters (``compiler.rollout.PoolSignals``) as
they arrive; ``controlplane.rollouts.signals`` publishes those counters to etcd, where the
replica that drives rollouts sums them over every replica.
"""

from __future__ import annotations

import email.utils
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import duration_pb2

from compiler.rollout import PoolSignals
from xdsserver.arrivals import ArrivalBook, route_cluster
from xdsserver.difficultylog import ScoreBook
from xdsserver.identity import FleetBinding, PeerCheck, check_peer
from xdsserver.snapshot import SnapshotCache
from xdsserver.status import ConnectionRegistry
from xdsserver.translate.listeners import ARRIVALS_LOG, DIFFICULTY_LOG, RETRY_AFTER
from xdsserver.translate.metadata import POOL_TAG
from xdsserver.translate.usage import USAGE_LOG_PREFIX
from xdsserver.usage import UsageBook
from xdsserver.work import WorkBook

log = logging.getLogger(__name__)


class PoolResolver(Protocol):
    """Which pool an upstream host of a cluster belongs to (None: not a pool's host)."""

    def __call__(self, cluster: str, address: str, port: int) -> str | None: ...


def _seconds(value: duration_pb2.Duration) -> float:
    return value.seconds + value.nanos / 1e9


DEFAULT_REST = 1.0
"""Seconds a paid pool rests after a 429 without a ``Retry-After`` kvpilot can read."""
MAX_REST = 3600.0
"""Longest rest a ``Retry-After`` can ask for; a longer one is cut to this."""


def retry_after_seconds(value: str, now: float) -> float:
    """Seconds from `now` that a ``Retry-After`` value asks for: delta-seconds or an HTTP
    date (RFC 9110, 10.2.3); ``DEFAULT_REST`` when it is neither, within ``MAX_REST``."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(text).timestamp() - now
        except (TypeError, ValueError, IndexError):
            seconds = DEFAULT_REST
    if not math.isfinite(seconds) or seconds < 0:
        seconds = DEFAULT_REST if not math.isfinite(seconds) else 0.0
    return min(seconds, MAX_REST)


class ProviderRests:
    """Paid pools that answered 429, and until when they rest (their ``Retry-After``).

    Learned from the access log of the Envoys connected to this replica: overflow skips a
    resting pool (``PolicyState.provider_backoff``) until the time it asked for has passed.
    A rest only grows: a late entry that asks for less does not shorten it. Other replicas
    learn it through etcd (``controlplane.rests``), which takes the rests that began or
    grew from ``changed``."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.until: dict[str, float] = {}
        """Pool -> wall-clock time its rest ends."""
        self.listeners: list[Callable[[], None]] = []
        """Called when a pool starts resting or rests longer (a rebuild is due)."""
        self.changed: set[str] = set()
        """Pools whose rest began or grew since ``take_changed`` was last called."""

    def observe(self, pool: str, retry_after: str | None) -> None:
        """A 429 from `pool`, with the ``Retry-After`` it carried (None: none)."""
        now = self.clock()
        seconds = retry_after_seconds(retry_after, now) if retry_after else DEFAULT_REST
        until = now + seconds
        # Whole tenths: entries of one burst of 429s do not each move the rest a little.
        if until > self.until.get(pool, -math.inf) + 0.1:
            self.until[pool] = until
            self.changed.add(pool)
            log.info("paid pool %s answered 429; it rests for %.1f s", pool, seconds)
            for listener in self.listeners:
                listener()

    def active(self, now: float) -> Mapping[str, float]:
        """The pools resting at `now`: pool -> until."""
        for pool in [pool for pool, until in self.until.items() if until <= now]:
            del self.until[pool]
        return dict(self.until)

    def take_changed(self) -> dict[str, float]:
        """The rests that began or grew since the last call that still run: pool -> until."""
        changed, self.changed = self.changed, set()
        return {pool: self.until[pool] for pool in sorted(changed) if pool in self.until}


class SignalBook:
    """Per (route cluster, pool) counters of every upstream attempt this replica was told about."""

    def __init__(self, resolve: PoolResolver) -> None:
        self.resolve = resolve
        self.counters: dict[str, dict[str, PoolSignals]] = {}
        """Cluster -> pool -> counters since this replica started."""
        self.by_fleet: dict[str, dict[str, dict[str, PoolSignals]]] = {}
        """Cluster -> fleet -> pool -> the same counters, by the fleet of the Envoy that
        logged them (a rollout that takes a canary fleet first judges its traffic alone)."""
        self.changed: set[str] = set()
        """Clusters with attempts since ``take_changed`` was last called."""
        self.unresolved = 0
        """Entries whose host belonged to no known pool (the plan moved on, say)."""
        self.listeners: list[Callable[[], None]] = []
        self.rests = ProviderRests()
        """Paid pools resting after a 429 (overflow)."""

    def observe(self, entry: Any, fleet: str = "") -> None:
        """Count one ``HTTPAccessLogEntry`` logged by an Envoy of ``fleet``."""
        common = entry.common_properties
        if common.access_log_type == accesslog_pb2.AccessLogType.UpstreamPoolReady:
            return  # an attempt's start (arrivals, on the same router): counted when it ends
        paid = common.custom_tags.get(POOL_TAG, "")
        if paid and entry.response.response_code.value == 429:
            self.rests.observe(paid, entry.response.response_headers.get(RETRY_AFTER))
        cluster = route_cluster(common.upstream_cluster)
        socket = common.upstream_remote_address.socket_address
        if not cluster or not socket.address:
            return  # no upstream: a local reply (no route, rate limited)
        pool = self.resolve(cluster, socket.address, socket.port_value)
        if pool is None:
            self.unresolved += 1
            return
        start = (
            _seconds(common.time_to_first_upstream_tx_byte)
            if common.HasField("time_to_first_upstream_tx_byte")
            else 0.0
        )
        ttfb = (
            max(0.0, _seconds(common.time_to_first_upstream_rx_byte) - start)
            if common.HasField("time_to_first_upstream_rx_byte")
            else None
        )
        latency = (
            max(0.0, _seconds(common.time_to_last_upstream_rx_byte) - start)
            if common.HasField("time_to_last_upstream_rx_byte")
            else None
        )
        status = (
            entry.response.response_code.value if entry.response.HasField("response_code") else 0
        )
        self.counters.setdefault(cluster, {}).setdefault(pool, PoolSignals()).observe(
            status, ttfb, latency
        )
        fleets = self.by_fleet.setdefault(cluster, {})
        fleets.setdefault(fleet, {}).setdefault(pool, PoolSignals()).observe(status, ttfb, latency)
        self.changed.add(cluster)

    def take_changed(self) -> set[str]:
        """Clusters that saw attempts since the last call."""
        changed, self.changed = self.changed, set()
        return changed


class AccessLogServer(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """``envoy.service.accesslog.v3.AccessLogService`` feeding a SignalBook.

    With ``binding`` (mutual TLS) a stream is taken only from a certificate bound to the fleet
    its node claims (or to ``*``): the same rule as ADS (``xdsserver.identity.check_peer``).
    Otherwise it is refused with PERMISSION_DENIED before any entry is counted, and recorded
    in ``status``: a certificate must not write another fleet's rollout signals.
    """

    def __init__(
        self,
        book: SignalBook,
        cache: SnapshotCache | None = None,
        *,
        binding: FleetBinding | None = None,
        status: ConnectionRegistry | None = None,
        scores: ScoreBook | None = None,
        usage: UsageBook | None = None,
        arrivals: ArrivalBook | None = None,
        work: WorkBook | None = None,
    ) -> None:
        self.book = book
        self.cache = cache
        """Maps an Envoy's node to the fleet it claims and the fleet whose config it is
        served; without it both are ``node.cluster``."""
        self.binding = binding
        self.status = status
        self.scores = scores
        """Where entries of virtual models' score logs go (``xdsserver.difficultylog``)."""
        self.usage = usage
        """Where entries of the usage logs (``kvpilot.usage/<listener>``) go."""
        self.arrivals = arrivals
        """Where entries of the arrivals logs (``xdsserver.arrivals``) go."""
        self.work = work
        """Where entries of the usage logs go as well, for the work they carried
        (``xdsserver.work``: overflow by arrivals' unit)."""

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register the service on a grpc.aio server (beside ADS)."""
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self, server)

    def _fleets(self, node: Any) -> tuple[str, str]:
        """(claimed, served) fleet of a node: the rule checks the claim, as ADS does; entries
        count for the fleet whose config the Envoy runs."""
        if self.cache is None:
            return str(node.cluster), str(node.cluster)
        return self.cache.fleet_for(node), self.cache.served_fleet(node)

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        fleet = ""
        checked = False
        log_name = ""
        async for message in request_iterator:
            # Envoy names itself (and the log) in the first message of a stream only; a
            # stream that does not is checked as a claim of the default fleet before anything
            # it sent counts. Each log config (upstream signals, a listener's score log, a
            # listener's usage log) has a stream of its own.
            if message.HasField("identifier") or not checked:
                node = message.identifier.node
                claimed, fleet = self._fleets(node)
                check = check_peer(self.binding, context.auth_context(), claimed)
                if check.refusal is not None:
                    await self._refuse(context, str(node.id), claimed, check)
                checked = True
                log_name = message.identifier.log_name
            if log_name.startswith(DIFFICULTY_LOG):
                if self.scores is not None:
                    for entry in message.http_logs.log_entry:
                        self.scores.observe(entry)
                continue
            if log_name.startswith(ARRIVALS_LOG):
                if self.arrivals is not None:
                    for entry in message.http_logs.log_entry:
                        self.arrivals.observe(entry, fleet)
                continue
            if log_name.startswith(USAGE_LOG_PREFIX):
                if self.usage is not None:
                    for entry in message.http_logs.log_entry:
                        self.usage.observe(entry)
                    self.usage.batch_done()
                if self.work is not None:
                    for entry in message.http_logs.log_entry:
                        self.work.observe(entry)
                continue
            for entry in message.http_logs.log_entry:
                self.book.observe(entry, fleet)
            for listener in self.book.listeners:
                listener()
        return als_pb2.StreamAccessLogsResponse()

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        node_id: str,
        fleet: str,
        check: PeerCheck,
    ) -> None:
        assert check.refusal is not None
        reason, message = check.refusal
        peer = str(context.peer())
        log.warning(
            "access-log signals refused node=%s fleet=%s identity=%s peer=%s: %s",
            node_id,
            fleet,
            check.identity,
            peer,
            message,
        )
        if self.status is not None:
            self.status.refused(
                node_id=node_id,
                fleet=fleet,
                identity=check.identity,
                peer=peer,
                reason=reason,
                message=message,
                service="signals",
            )
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
