"""The reconcile loop's Prometheus metrics: rebuilds and their paths, pushes by cause, invalid
objects and diagnostics, telemetry's weights and ages, admission per route, and each pool's
endpoints by the health sent to Envoy. ``Reconciler`` sets them; this module names them."""

from __future__ import annotations

import contextlib
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from compiler import RoutingPlan
from compiler.compile import pool_endpoints
from policies import EndpointHealth
from signals import PolicyState


class ReconcileMetrics:
    """Prometheus metrics of the reconcile loop."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kwargs: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.builds = Counter(
            "kvpilot_reconcile_builds",
            "Snapshot rebuilds, by path: fast (endpoints only), routes (listeners and routes "
            "only) or full.",
            ["path"],
            **kwargs,
        )
        self.build_seconds = Histogram(
            "kvpilot_reconcile_build_seconds",
            "Time to decode, compile, translate and publish one rebuild.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            **kwargs,
        )
        self.invalid_objects = Gauge(
            "kvpilot_invalid_objects", "Values in etcd that failed validation.", **kwargs
        )
        self.diagnostics = Gauge(
            "kvpilot_plan_diagnostics",
            "Problems found while compiling, by severity.",
            ["severity"],
            **kwargs,
        )
        self.pushes = Counter(
            "kvpilot_snapshot_pushes",
            "Fleet snapshots that changed (and so were pushed to that fleet's Envoys), by cause: "
            "telemetry, endpoints or config.",
            ["cause"],
            **kwargs,
        )
        self.telemetry_age = Gauge(
            "kvpilot_telemetry_age_seconds",
            "Age of each endpoint's latest telemetry record.",
            ["pool", "endpoint"],
            **kwargs,
        )
        self.weight_changes = Counter(
            "kvpilot_telemetry_weight_changes",
            "Endpoint weight or health changes decided from telemetry.",
            ["pool"],
            **kwargs,
        )
        self.telemetry_weight = Gauge(
            "kvpilot_telemetry_weight",
            "Endpoint weight decided from telemetry, for telemetry-balanced pools.",
            ["pool", "endpoint"],
            **kwargs,
        )
        self.degraded = Gauge(
            "kvpilot_telemetry_degraded_endpoints",
            "Endpoints marked DEGRADED because telemetry shows them saturated.",
            ["pool"],
            **kwargs,
        )
        self.admission_pressure = Gauge(
            "kvpilot_admission_pressure",
            "Pressure of a route's first-tier pool from telemetry (1 = saturated), for routes "
            "with service classes; NaN without fresh telemetry.",
            ["route"],
            **kwargs,
        )
        self.admission_admitted = Gauge(
            "kvpilot_admission_admitted_ratio",
            "Share of a service class's requests that Envoy admits on a route (the rest are "
            "shed or diverted).",
            ["route", "service_class"],
            **kwargs,
        )
        self.admission_changes = Counter(
            "kvpilot_admission_changes",
            "Admission level changes of a route, by direction: restrict or readmit.",
            ["route", "direction"],
            **kwargs,
        )
        self.overflow_share = Gauge(
            "kvpilot_overflow_share",
            "Share of a route's requests sent to its paid pools (overflow), 0 to 1, by kind: "
            "requests (without a session header) or sessions (conversations).",
            ["route", "kind"],
            **kwargs,
        )
        self.overflow_pressure = Gauge(
            "kvpilot_overflow_pressure",
            "Pressure of a route's first-tier replicas as overflow reads it (1 = saturated); "
            "NaN without fresh telemetry.",
            ["route"],
            **kwargs,
        )
        self.overflow_prefill_weight = Gauge(
            "kvpilot_overflow_prefill_weight",
            "What an uncached prompt token counts against an output token in a route's overflow "
            "by arrivals, by source: set (the route's prefillWeight), learned (from its owned "
            "engines' counters while full) or default (0.1, until the fit can say).",
            ["route", "source"],
            **kwargs,
        )
        self.overflow_resting = Gauge(
            "kvpilot_overflow_resting",
            "1 while a paid pool rests after a 429, until its Retry-After has passed; else 0.",
            ["route", "pool"],
            **kwargs,
        )
        self.saturated = Gauge(
            "kvpilot_route_saturated",
            "1 while a telemetry route's first-tier replicas count as saturated, so its session "
            "requests take the tighter bounded load (saturatedHashBalanceFactor); else 0.",
            ["route"],
            **kwargs,
        )
        self.bounded_load = Gauge(
            "kvpilot_route_bounded_load",
            "The bounded load (percent of the mean requests in flight) a capacity-bound "
            "telemetry route's session requests take now (sessionAffinity.capacityBound); 0: "
            "none (the ladder's top rung, while all requests in flight fit one replica's batch).",
            ["route"],
            **kwargs,
        )
        self.bounded_load_changes = Counter(
            "kvpilot_bounded_load_changes",
            "Changes of the bounded load a telemetry route's session requests take (a rung "
            "of a capacityBound ladder, or between the usual and the saturated bound): each a "
            "route update (RDS) to another twin of the same ring, never a cluster update.",
            ["route"],
            **kwargs,
        )
        self.batch_fill = Gauge(
            "kvpilot_route_batch_fill",
            "Mean batch fill ((running + waiting) / batch size) of a telemetry route's "
            "first-tier replicas; NaN without fresh telemetry that knows the batch size.",
            ["route"],
            **kwargs,
        )
        self.pool_endpoints = Gauge(
            "kvpilot_pool_endpoints",
            "Endpoints of each pool (static and registered), by the health kvpilot sends to "
            "Envoy: healthy, degraded, draining or unhealthy.",
            ["pool", "health"],
            **kwargs,
        )
        self._endpoint_counts: dict[str, tuple[tuple[object, ...], dict[str, int]]] = {}
        """Pool -> (the objects it was counted from, its endpoints by health)."""

    def count_endpoints(self, state: PolicyState, plan: RoutingPlan) -> None:
        """Set ``kvpilot_pool_endpoints``: every pool's endpoints by the health sent to Envoy
        (telemetry may have marked some degraded). Every health has a series, zeros included,
        so an alert on "no healthy endpoint" sees a 0, not a missing series. A pool is counted
        again only when its object, its registered endpoints or its telemetry decisions are
        not the very objects of the last count, so a change costs its own pool."""
        counted: dict[str, tuple[tuple[object, ...], dict[str, int]]] = {}
        for name, pool in state.pools.items():
            decisions = plan.weights.get(name)
            inputs = (pool, state.registered.get(name), decisions)
            known = self._endpoint_counts.get(name)
            if known is not None and all(a is b for a, b in zip(known[0], inputs, strict=True)):
                counted[name] = known
                continue
            counts = dict.fromkeys(get_args(EndpointHealth), 0)
            for endpoint in pool_endpoints(pool, state.registered.get(name, {})):
                decision = decisions.get(endpoint.key) if decisions is not None else None
                health = (
                    "degraded" if decision is not None and decision.degraded else endpoint.health
                )
                counts[health] += 1
            if known is None or known[1] != counts:
                for health, count in counts.items():
                    self.pool_endpoints.labels(name, health).set(count)
            counted[name] = (inputs, counts)
        for name in self._endpoint_counts.keys() - counted.keys():
            for health in get_args(EndpointHealth):
                with contextlib.suppress(KeyError):
                    self.pool_endpoints.remove(name, health)
        self._endpoint_counts = counted
