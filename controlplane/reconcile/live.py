"""What telemetry decided at the last compile: endpoint weights (``signals.weights``),
admission per service class (``signals.admission``) and the saturation of telemetry routes
(``signals.saturation``). The reconciler hands them to the next compile for hysteresis; this
module exports them as metrics, logs their changes, and says when a rebuild is due although
nothing in etcd changed (a record going stale, an admission step, a saturated route's dwell
ending)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping

from compiler import RoutingPlan
from controlplane.reconcile.metrics import ReconcileMetrics
from policies.models import TELEMETRY_MAX_AGE
from signals import PolicyState
from signals.admission import AdmissionDecision
from signals.overflow import OverflowDecision
from signals.saturation import SaturationDecision, bound_text, exported_bound
from signals.spill import SpillDecision
from signals.weights import WeightDecision

log = logging.getLogger(__name__)
WEIGHT_SOURCES = ("set", "learned", "stored", "default")
"""Values of ``kvpilot_overflow_prefill_weight``'s ``source`` label
(``ArrivalsDecision.weight_source``)."""


class LiveDecisions:
    """The last compile's live decisions, their metrics and when they next need a rebuild."""

    def __init__(self, metrics: ReconcileMetrics) -> None:
        self.metrics = metrics
        self.weights: Mapping[str, Mapping[str, WeightDecision]] = {}
        self.admission: Mapping[str, AdmissionDecision] = {}
        self.saturation: Mapping[str, SaturationDecision] = {}
        self.spill: Mapping[str, SpillDecision] = {}
        self.overflow: Mapping[str, OverflowDecision] = {}
        self._stale_at = math.inf
        self._spill_at = math.inf
        self._step_at = math.inf
        self._calm_at = math.inf
        self._overflow_at = math.inf

    @property
    def due_at(self) -> float:
        """When a rebuild is due although nothing changes (``self.clock()`` of the
        reconciler; infinite when none is)."""
        return min(self._stale_at, self._step_at, self._calm_at, self._spill_at, self._overflow_at)

    @due_at.setter
    def due_at(self, value: float) -> None:
        self._stale_at = self._step_at = self._calm_at = value
        self._spill_at = self._overflow_at = value

    def track(self, state: PolicyState, plan: RoutingPlan) -> None:
        """Take the decisions of the compile of `state` into `plan`."""
        self._track_weights(state, plan)
        self._track_admission(plan)
        self._track_saturation(plan)
        self._track_spill(plan)
        self._track_overflow(plan)

    def _track_weights(self, state: PolicyState, plan: RoutingPlan) -> None:
        """Keep telemetry decisions for hysteresis, count changes, and schedule the rebuild
        that returns the first fresh record to neutral when it goes stale."""
        next_stale = math.inf
        for pool, decisions in plan.weights.items():
            before = self.weights.get(pool, {})
            spec = state.pools[pool].spec.telemetry if pool in state.pools else None
            max_age = spec.max_age if spec is not None else TELEMETRY_MAX_AGE
            for endpoint_id, decision in decisions.items():
                old = before.get(endpoint_id)
                if old is None or old.weight != decision.weight:
                    self.metrics.telemetry_weight.labels(pool, endpoint_id).set(decision.weight)
                if old is not None and (old.weight, old.degraded) != (
                    decision.weight,
                    decision.degraded,
                ):
                    self.metrics.weight_changes.labels(pool).inc()
                if not decision.neutral and decision.age is not None:
                    next_stale = min(next_stale, state.now - decision.age + max_age)
            self.metrics.degraded.labels(pool).set(sum(d.degraded for d in decisions.values()))
        # The gauges hold exactly the last decisions: drop the series of endpoints and pools
        # that have none now.
        for pool, decisions in self.weights.items():
            kept = plan.weights.get(pool, {})
            for endpoint_id in decisions.keys() - kept.keys():
                self.metrics.telemetry_weight.remove(pool, endpoint_id)
            if pool not in plan.weights:
                self.metrics.degraded.remove(pool)
        self.weights = plan.weights
        # A little after the deadline, so the record is stale by then on any rounding.
        self._stale_at = next_stale + 0.05

    def _track_admission(self, plan: RoutingPlan) -> None:
        """Keep admission decisions for hysteresis, export them, and schedule the rebuild at
        which the level would take its next step."""
        metrics = self.metrics
        for route, decision in plan.admission.items():
            before = self.admission.get(route)
            metrics.admission_pressure.labels(route).set(
                math.nan if decision.pressure is None else decision.pressure
            )
            for service_class, share in (decision.admitted or {}).items():
                metrics.admission_admitted.labels(route, service_class).set(share)
            if before is not None and before.level != decision.level:
                direction = "restrict" if decision.level > before.level else "readmit"
                metrics.admission_changes.labels(route, direction).inc()
                log.info(
                    "admission on %s: level %d -> %d at pressure %s; admitted %s",
                    route,
                    before.level,
                    decision.level,
                    decision.pressure,
                    dict(decision.admitted or {}),
                )
        for route, decision in self.admission.items():
            if route not in plan.admission:
                metrics.admission_pressure.remove(route)
                for service_class in decision.admitted or {}:
                    with contextlib.suppress(KeyError):
                        metrics.admission_admitted.remove(route, service_class)
        self.admission = plan.admission
        # A little after the step is due, so the interval has passed on any rounding.
        self._step_at = (
            min((d.next_step_at for d in plan.admission.values()), default=math.inf) + 0.05
        )

    def _track_saturation(self, plan: RoutingPlan) -> None:
        """Keep saturation decisions for hysteresis, export them and log each change."""
        metrics = self.metrics
        for route, decision in plan.saturation.items():
            metrics.saturated.labels(route).set(int(decision.saturated))
            metrics.batch_fill.labels(route).set(
                math.nan if decision.fill is None else decision.fill
            )
            before = self.saturation.get(route)
            if before is not None and before.ladder is not decision.ladder and decision.path:
                log.info("%s: bounded load from %s", route, decision.path)
            if before is not None and before.factor and not decision.factor:
                metrics.bounded_load.remove(route)
            if decision.factor:
                metrics.bounded_load.labels(route).set(exported_bound(decision.factor))
                if before is not None and before.factor and before.factor != decision.factor:
                    metrics.bounded_load_changes.labels(route).inc()
                    log.info(
                        "%s: at batch fill %s (held peak %s in flight) the busiest replica "
                        "fits its usable batch at %s%%; session requests take %s (was %s)",
                        route,
                        decision.fill,
                        decision.peak,
                        decision.wanted,
                        bound_text(decision.factor),
                        bound_text(before.factor),
                    )
                continue
            if before is not None and before.saturated != decision.saturated:
                # A change of twin all the same: counted as a ladder's change of rung is.
                metrics.bounded_load_changes.labels(route).inc()
                log.info(
                    "%s: replicas %s at batch fill %s; session requests take the %s bound",
                    route,
                    "saturated" if decision.saturated else "calm again",
                    decision.fill,
                    "saturated" if decision.saturated else "usual",
                )
        for route in self.saturation.keys() - plan.saturation.keys():
            metrics.saturated.remove(route)
            metrics.batch_fill.remove(route)
            if self.saturation[route].factor:
                metrics.bounded_load.remove(route)
        self.saturation = plan.saturation
        # A little after the dwell ends, so it has passed on any rounding.
        self._calm_at = min((d.calm_at for d in plan.saturation.values()), default=math.inf) + 0.05

    def _track_spill(self, plan: RoutingPlan) -> None:
        """Keep each located fleet's spill for hysteresis, log each change, and schedule the
        rebuild of a locality that is taking its traffic back step by step."""
        for key, decision in plan.spill.items():
            before = self.spill.get(key)
            if before is not None and before.keep != decision.keep:
                log.info(
                    "%s: own locality keeps %.0f%% of the traffic (was %.0f%%; %d replicas, "
                    "batch fill %s; arrivals %s/s, capacity %s/s (slots %s/s, completed "
                    "%s/s), queued %s, drain %s/s, trim %s; cluster load %s, level %s)",
                    key,
                    100 * decision.keep,
                    100 * before.keep,
                    decision.local,
                    decision.fill,
                    decision.arrivals,
                    decision.capacity,
                    decision.slot_capacity,
                    decision.completed,
                    decision.queued,
                    decision.drain,
                    decision.trim,
                    decision.mean_load,
                    decision.level,
                )
        self.spill = plan.spill
        self._spill_at = min((d.next_at for d in plan.spill.values()), default=math.inf) + 0.05

    def _track_overflow(self, plan: RoutingPlan) -> None:
        """Keep overflow decisions for hysteresis, log each change of paid share or pool, and
        schedule the rebuild of the next step or of a resting pool's return."""
        metrics = self.metrics
        for route, decision in plan.overflow.items():
            metrics.overflow_share.labels(route, "requests").set(decision.plain)
            metrics.overflow_share.labels(route, "sessions").set(decision.sessions)
            metrics.overflow_pressure.labels(route).set(
                math.nan if decision.pressure is None else decision.pressure
            )
            arrivals = decision.arrivals
            if arrivals is not None:
                source = arrivals.weight_source
                metrics.overflow_prefill_weight.labels(route, source).set(arrivals.prefill_weight)
                for other in WEIGHT_SOURCES:
                    if other != source:
                        with contextlib.suppress(KeyError):
                            metrics.overflow_prefill_weight.remove(route, other)
                last = self.overflow.get(route)
                last_source = last.arrivals.weight_source if last and last.arrivals else None
                if source == "stored" and last_source != "stored":
                    log.info(
                        "overflow on %s: a prefilled token counts %.3f of an output token, as "
                        "stored in etcd for these owned pools and batch size (%d busy "
                        "intervals); the fit goes on learning from it",
                        route,
                        arrivals.prefill_weight,
                        arrivals.fit.intervals,
                    )
                elif source == "learned" and last_source not in ("learned", "stored"):
                    log.info(
                        "overflow on %s: a prefilled token now counts %.3f of an output token, "
                        "learned from %d busy intervals of the owned engines",
                        route,
                        arrivals.prefill_weight,
                        arrivals.fit.intervals,
                    )
            was = self.overflow.get(route)
            for pool in set(decision.resting) | set(was.resting if was is not None else ()):
                metrics.overflow_resting.labels(route, pool).set(int(pool in decision.resting))
            before = self.overflow.get(route)
            if before is not None and (before.plain, before.sessions, before.provider) != (
                decision.plain,
                decision.sessions,
                decision.provider,
            ):
                log.info(
                    "overflow on %s: %s takes %.0f%% of requests and %.0f%% of conversations "
                    "at pressure %s (resting: %s)%s",
                    route,
                    decision.provider or "no paid pool",
                    decision.plain * 100,
                    decision.sessions * 100,
                    decision.pressure,
                    sorted(decision.resting) or "none",
                    f"; {decision.arrivals.why}" if decision.arrivals is not None else "",
                )
        for route in self.overflow.keys() - plan.overflow.keys():
            for kind in ("requests", "sessions"):
                metrics.overflow_share.remove(route, kind)
            metrics.overflow_pressure.remove(route)
            for source in WEIGHT_SOURCES:
                with contextlib.suppress(KeyError):
                    metrics.overflow_prefill_weight.remove(route, source)
        self.overflow = plan.overflow
        self._overflow_at = (
            min((d.next_step_at for d in plan.overflow.values()), default=math.inf) + 0.05
        )
