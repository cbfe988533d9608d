"""What every connected Envoy has, what it rejected and why; plus the xDS Prometheus metrics.

The ADS server reports each event here. The REST status endpoint reads `as_dict()`, and the
daemon can mirror changes elsewhere (etcd) through `add_listener`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from xdsserver.identity import REFUSAL_REASONS
from xdsserver.resources import short_name

log = logging.getLogger(__name__)

Mode = Literal["sotw", "delta"]
Service = Literal["ads", "signals"]
"""The two services on kvpilot's gRPC port that the identity rule guards."""
Event = Literal["connected", "disconnected", "subscribed", "sent", "acked", "nacked"]
Listener = Callable[[Event, "ConnectionStatus"], None]

MAX_REFUSALS = 100
"""Refused Envoys kept for the status page (most recent first)."""


@dataclass
class Nack:
    """The last configuration an Envoy rejected."""

    version: str
    """The version that was rejected (what the server sent with the NACKed nonce)."""
    nonce: str
    message: str
    """Envoy's error_detail message: why it rejected the configuration."""
    at: float
    """Wall-clock time (seconds since the epoch)."""
    resolved_at: float | None = None
    """When the Envoy first ACKed a response sent after the rejected one (None: it has not)."""
    resolved_by: str = ""
    """The version that ACK accepted."""


@dataclass
class TypeStatus:
    """One resource type on one stream."""

    type_url: str
    version_sent: str = ""
    version_acked: str = ""
    """The version the Envoy last accepted; after a NACK it keeps running this one."""
    nonce: str = ""
    """Nonce of the last response sent."""
    acked_at: float | None = None
    """Wall-clock time of the last ACK (or of a resume at the version it holds)."""
    unacked_since: float | None = None
    """Wall-clock time since which the version sent has not been ACKed; None when in sync."""
    last_nack: Nack | None = None
    wildcard: bool = False
    resource_names: list[str] = field(default_factory=list)
    """Names the Envoy subscribed to explicitly (sorted)."""


@dataclass
class ConnectionStatus:
    """One ADS stream from one Envoy."""

    stream_id: int
    node_id: str
    fleet: str
    peer: str
    mode: Mode
    connected_since: float
    """Wall-clock time (seconds since the epoch)."""
    types: dict[str, TypeStatus] = field(default_factory=dict)
    identity: str = ""
    """The client certificate's identity (its first SAN) when ADS runs with mutual TLS."""
    warming: list[str] = field(default_factory=list)
    """Clusters the Envoy was sent and has not confirmed warm: its LDS and RDS changes wait."""
    warming_since: float | None = None
    """Wall-clock time since which they wait (None: nothing waits)."""

    def type(self, type_url: str) -> TypeStatus:
        status = self.types.get(type_url)
        if status is None:
            status = self.types[type_url] = TypeStatus(type_url)
        return status

    def as_dict(self) -> dict[str, Any]:
        types: dict[str, Any] = {}
        for type_url, t in self.types.items():
            nack = t.last_nack
            types[type_url] = {
                "type": short_name(type_url),
                "version_sent": t.version_sent,
                "version_acked": t.version_acked,
                "nonce": t.nonce,
                "acked_at": t.acked_at,
                "unacked_since": t.unacked_since,
                "wildcard": t.wildcard,
                "resource_names": list(t.resource_names),
                "last_nack": None
                if nack is None
                else {
                    "version": nack.version,
                    "nonce": nack.nonce,
                    "message": nack.message,
                    "at": nack.at,
                    "resolved": None
                    if nack.resolved_at is None
                    else {"version": nack.resolved_by, "at": nack.resolved_at},
                },
            }
        return {
            "stream_id": self.stream_id,
            "node_id": self.node_id,
            "fleet": self.fleet,
            "peer": self.peer,
            "mode": self.mode,
            "identity": self.identity,
            "connected_since": self.connected_since,
            "warming": {"clusters": list(self.warming), "since": self.warming_since}
            if self.warming_since is not None
            else None,
            "types": types,
        }


@dataclass
class Refusal:
    """An Envoy that was refused config: what it claimed, who its certificate says it is, why."""

    node_id: str
    fleet: str
    """The fleet the node claimed (or was mapped to by node id)."""
    identity: str
    peer: str
    reason: str
    """``unbound_identity`` or ``fleet_mismatch`` (``xdsserver.identity.REFUSAL_REASONS``)."""
    message: str
    at: float
    """Wall-clock time of the latest refusal (seconds since the epoch)."""
    count: int = 1
    """Refusals of this node, claim and identity so far (Envoy retries with backoff)."""
    service: Service = "ads"
    """The stream refused: ``ads`` (config) or ``signals`` (access logs for rollouts)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "fleet": self.fleet,
            "identity": self.identity,
            "peer": self.peer,
            "reason": self.reason,
            "message": self.message,
            "at": self.at,
            "count": self.count,
            "service": self.service,
        }


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.streams = Gauge(
            "kvpilot_xds_streams", "Open ADS streams.", ["mode"], registry=registry
        )
        self.pushes = Counter(
            "kvpilot_xds_pushes_total", "xDS responses sent.", ["type"], registry=registry
        )
        self.acks = Counter(
            "kvpilot_xds_acks_total",
            "xDS responses accepted by Envoys.",
            ["type"],
            registry=registry,
        )
        self.nacks = Counter(
            "kvpilot_xds_nacks_total",
            "xDS responses rejected by Envoys.",
            ["type", "fleet"],
            registry=registry,
        )
        self.refused = Counter(
            "kvpilot_xds_refused_total",
            "ADS streams refused because the client certificate does not allow the claimed "
            "fleet. A client without a certificate signed by the client CA is not counted: the "
            "TLS handshake refuses it before any stream opens (its Envoy never connects: "
            "control_plane.connected_state 0).",
            ["reason"],
            registry=registry,
        )
        self.signals_refused = Counter(
            "kvpilot_signals_refused_total",
            "Access-log signal streams refused because the client certificate does not allow "
            "the fleet the stream reports for (nothing it sent was counted).",
            ["reason"],
            registry=registry,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason=reason)
            self.signals_refused.labels(reason=reason)
        self.warming_seconds = Histogram(
            "kvpilot_xds_cluster_warming_seconds",
            "Time from a CDS response adding clusters to the Envoy's answer to it (Envoy "
            "answers once they finished warming; routes wait for it).",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.warming_timeouts = Counter(
            "kvpilot_xds_warming_timeouts_total",
            "Times routes went to an Envoy without its answer to the CDS response adding "
            "their clusters, after waiting the longest they may.",
            ["fleet"],
            registry=registry,
        )
        self.push_seconds = Histogram(
            "kvpilot_xds_push_seconds",
            "Time from set_snapshot to the response being sent on a stream.",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )


class _SyncCollector(Collector):
    """``kvpilot_xds_unacked_seconds``: per fleet, how long the longest-waiting Envoy of this
    replica has gone without ACKing the version it was sent (0 when all are in sync). Computed
    at scrape time, so an Envoy stuck on a NACK shows a growing age, not a stale one."""

    def __init__(self, registry: ConnectionRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvpilot_xds_unacked_seconds",
            "Per fleet, the longest time an Envoy connected to this replica has gone without "
            "ACKing the configuration it was sent (0 when every Envoy is in sync).",
            labels=["fleet"],
        )
        for fleet, seconds in sorted(self._registry.unacked_seconds().items()):
            family.add_metric([fleet], seconds)
        yield family


class ConnectionRegistry:
    """Status of every open ADS stream, and the xDS metrics.

    Pass a fresh `CollectorRegistry` when several registries live in one process (tests);
    the default is prometheus_client's global registry.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        target = registry if registry is not None else REGISTRY
        self._metrics = _Metrics(target)
        target.register(_SyncCollector(self))
        self._clock = clock
        self._connections: dict[int, ConnectionStatus] = {}
        self._listeners: list[Listener] = []
        self._next_id = 0
        self._refusals: dict[tuple[str, str, str, str], Refusal] = {}

    # Reading -------------------------------------------------------------------------------

    def connections(self) -> list[ConnectionStatus]:
        """A copy of the status of every open stream, oldest first."""
        return [copy.deepcopy(c) for c in self._connections.values()]

    def newest(self, node_id: str) -> ConnectionStatus | None:
        """The newest open stream of one Envoy, live (not a copy: read it at once), or None."""
        newest = None
        for c in self._connections.values():
            if c.node_id == node_id:
                newest = c
        return newest

    def find(self, node_id: str) -> list[ConnectionStatus]:
        """Copies of the open streams of one Envoy (usually one)."""
        return [copy.deepcopy(c) for c in self._connections.values() if c.node_id == node_id]

    def refusals(self) -> list[Refusal]:
        """Copies of the recent refusals, newest first."""
        ordered = sorted(self._refusals.values(), key=lambda r: r.at, reverse=True)
        return [copy.copy(r) for r in ordered]

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view for the REST status endpoint."""
        return {
            "connections": [c.as_dict() for c in self._connections.values()],
            "refused": [r.as_dict() for r in self.refusals()],
        }

    def unacked_seconds(self) -> dict[str, float]:
        """Fleet -> the longest any of its streams has waited for an ACK now (0 if none)."""
        now = self._clock()
        out: dict[str, float] = {}
        for connection in self._connections.values():
            waiting = [
                now - t.unacked_since
                for t in connection.types.values()
                if t.unacked_since is not None
            ]
            out[connection.fleet] = max([out.get(connection.fleet, 0.0), *waiting])
        return out

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(event, status)` on every change; returns a function that removes it.

        Listeners run synchronously on the event loop: keep them cheap (hand off to a task
        for I/O). Their exceptions are logged, never raised into the ADS stream.
        """
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    # Reporting (called by the ADS server) ----------------------------------------------------

    def open(
        self, *, node_id: str, fleet: str, peer: str, mode: Mode, identity: str = ""
    ) -> ConnectionStatus:
        self._next_id += 1
        status = ConnectionStatus(
            stream_id=self._next_id,
            node_id=node_id,
            fleet=fleet,
            peer=peer,
            mode=mode,
            connected_since=self._clock(),
            identity=identity,
        )
        self._connections[status.stream_id] = status
        self._metrics.streams.labels(mode=mode).inc()
        self._notify("connected", status)
        return status

    def refused(
        self,
        *,
        node_id: str,
        fleet: str,
        identity: str,
        peer: str,
        reason: str,
        message: str,
        service: Service = "ads",
    ) -> None:
        """A stream was refused (its Envoy got nothing, or nothing it sent was counted).
        Repeats of one service, node, claim and identity update one record; the oldest
        records go when more than `MAX_REFUSALS` are kept."""
        counter = self._metrics.refused if service == "ads" else self._metrics.signals_refused
        counter.labels(reason=reason).inc()
        key = (service, node_id, fleet, identity)
        known = self._refusals.pop(key, None)
        count = known.count + 1 if known is not None else 1
        self._refusals[key] = Refusal(
            node_id, fleet, identity, peer, reason, message, self._clock(), count, service
        )
        while len(self._refusals) > MAX_REFUSALS:
            del self._refusals[next(iter(self._refusals))]

    def close(self, status: ConnectionStatus) -> None:
        if self._connections.pop(status.stream_id, None) is None:
            return
        self._metrics.streams.labels(mode=status.mode).dec()
        self._notify("disconnected", status)

    def subscribed(
        self, status: ConnectionStatus, type_url: str, names: Iterable[str], *, wildcard: bool
    ) -> None:
        t = status.type(type_url)
        t.resource_names = sorted(names)
        t.wildcard = wildcard
        self._notify("subscribed", status)

    def sent(
        self,
        status: ConnectionStatus,
        type_url: str,
        *,
        version: str,
        nonce: str,
        changed_at: float | None = None,
    ) -> None:
        """A response went out; `changed_at` is the `time.monotonic()` of the snapshot change
        that caused it, if one did."""
        t = status.type(type_url)
        t.version_sent = version
        t.nonce = nonce
        if version == t.version_acked:
            t.unacked_since = None
        elif t.unacked_since is None:
            t.unacked_since = self._clock()
        self._metrics.pushes.labels(type=short_name(type_url)).inc()
        if changed_at is not None:
            self._metrics.push_seconds.observe(max(0.0, time.monotonic() - changed_at))
        self._notify("sent", status)

    def acked(self, status: ConnectionStatus, type_url: str, *, version: str) -> None:
        t = status.type(type_url)
        t.version_acked = version
        if t.last_nack is not None and t.last_nack.resolved_at is None:
            # Envoys answer in order: this ACK is for a response sent after the rejected one.
            t.last_nack.resolved_at = self._clock()
            t.last_nack.resolved_by = version
        t.acked_at = self._clock()
        if version == t.version_sent:
            t.unacked_since = None
        self._metrics.acks.labels(type=short_name(type_url)).inc()
        self._notify("acked", status)

    def resumed(self, status: ConnectionStatus, type_url: str, *, version: str) -> None:
        """The Envoy reconnected holding `version` already (its request said so), so nothing
        was sent: record what it runs. Not counted as an ACK."""
        t = status.type(type_url)
        if t.version_acked == version:
            return
        t.version_acked = version
        t.acked_at = self._clock()
        if version == t.version_sent:
            t.unacked_since = None
        self._notify("acked", status)

    def nacked(
        self, status: ConnectionStatus, type_url: str, *, version: str, nonce: str, message: str
    ) -> None:
        status.type(type_url).last_nack = Nack(
            version=version, nonce=nonce, message=message, at=self._clock()
        )
        self._metrics.nacks.labels(type=short_name(type_url), fleet=status.fleet).inc()
        self._notify("nacked", status)

    def warming(self, status: ConnectionStatus, clusters: Iterable[str]) -> None:
        """The Envoy was sent new clusters; its routes wait until they are warm."""
        status.warming = sorted(clusters)
        if status.warming_since is None:
            status.warming_since = self._clock()

    def warmed(self, status: ConnectionStatus, *, seconds: float, timed_out: bool) -> None:
        """The wait for warming clusters ended: answered, or after its limit."""
        status.warming, status.warming_since = [], None
        if timed_out:
            self._metrics.warming_timeouts.labels(fleet=status.fleet).inc()
        else:
            self._metrics.warming_seconds.observe(seconds)

    def _notify(self, event: Event, status: ConnectionStatus) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, status)
            except Exception:
                log.exception("connection status listener failed on %s", event)
