"""The live stage of compilation: endpoint weights from telemetry for the pools of
``balancing: telemetry`` routes (``signals.weights``), the admitted share of each class
for the routes of policies with service classes (``signals.admission``), which bounded
load the session requests of a telemetry route take (``signals.saturation``), and the share
of a route's requests that its paid pools take (``signals.overflow``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.models import TELEMETRY_MAX_AGE, Endpoint, Overflow, Route
from policies.names import cluster_name
from signals.admission import AdmissionDecision, Signal, decide, pool_signals, pressure_of
from signals.overflow import (
    OverflowDecision,
    decide_overflow,
    decide_overflow_arrivals,
    overflow_signals,
    provider_order,
)
from signals.overflowdemand import blend_demand, route_demand
from signals.overflowwork import ReplicaLoad, computed_rate
from signals.prefillfit import PrefillFit, route_weight
from signals.prefillrecord import fit_scope, seeded
from signals.saturation import (
    SaturationDecision,
    batch_fill,
    decide_capacity_route,
    decide_saturation,
    mean_fill,
    mean_in_flight,
    saturated_fill,
    sized_records,
)
from signals.state import PolicyState, is_external, pool_endpoints
from signals.telemetry import TelemetryRecord
from signals.weights import WeightDecision, WeightParams, pool_weights


def telemetry_weights(state: PolicyState) -> dict[str, dict[str, WeightDecision]]:
    """Weights from telemetry for every pool that a ``balancing: telemetry`` route uses: pool
    name -> endpoint key -> decision. A pool behind session affinity in any such route is
    quantized coarsely (it shares one ClusterLoadAssignment with its hash cluster)."""
    affinity: dict[str, bool] = {}
    for policy in state.policies.values():
        for route in policy.spec.routes:
            if route.balancing != "telemetry":
                continue
            for tier in route.tiers:
                for target in tier.pools:
                    affinity[target.pool] = affinity.get(target.pool, False) or (
                        route.session_affinity is not None
                    )
    out: dict[str, dict[str, WeightDecision]] = {}
    for name in sorted(affinity):
        pool = state.pools.get(name)
        if pool is None:
            continue
        source = pool.spec.telemetry
        out[name] = pool_weights(
            pool_endpoints(pool, state.registered.get(name, {})),
            state.telemetry.get(name, {}),
            now=state.now,
            previous=state.previous_weights.get(name, {}),
            params=WeightParams(max_age=source.max_age) if source else WeightParams(),
            affinity=affinity[name],
        )
    return out


def _first_tier(
    state: PolicyState, route: Route
) -> tuple[list[Endpoint], dict[str, TelemetryRecord], float]:
    """The replicas of a route's first tier (``_owned_pools``), their telemetry by endpoint
    key and the shortest ``maxAge`` of their pools."""
    endpoints: list[Endpoint] = []
    telemetry: dict[str, TelemetryRecord] = {}
    max_age = TELEMETRY_MAX_AGE
    for name in _owned_pools(state, route):
        pool = state.pools[name]
        endpoints.extend(pool_endpoints(pool, state.registered.get(name, {})))
        telemetry.update(state.telemetry.get(name, {}))
        if pool.spec.telemetry is not None:
            max_age = min(max_age, pool.spec.telemetry.max_age)
    return endpoints, telemetry, max_age


def _owned_pools(state: PolicyState, route: Route) -> list[str]:
    """The pools of a route's first tier that take its traffic on owned replicas: external
    providers and pools weighted 0 left out."""
    return [
        target.pool
        for target in route.tiers[0].pools
        if (pool := state.pools.get(target.pool)) is not None
        and not is_external(pool)
        and target.weight != 0
    ]


def admission_decisions(state: PolicyState) -> dict[str, AdmissionDecision]:
    """Admission for every route of every policy with service classes: route cluster name
    (``policy/route``) -> decision, from the pressure of the route's first-tier replicas."""
    out: dict[str, AdmissionDecision] = {}
    for policy_name in sorted(state.policies):
        spec = state.policies[policy_name].spec
        classes = spec.service_classes
        if classes is None:
            continue
        for route in spec.routes:
            endpoints, telemetry, max_age = _first_tier(state, route)
            signals = pool_signals(
                endpoints,
                telemetry,
                now=state.now,
                max_age=max_age,
                saturation=classes.saturation,
                ttft_bound=classes.ttft_bound,
            )
            name = cluster_name(policy_name, route.name)
            out[name] = decide(
                state.previous_admission.get(name),
                pressure_of(signals),
                classes.classes,
                now=state.now,
                saturation=classes.saturation,
                signals=signals,
            )
    return out


def saturation_decisions(state: PolicyState) -> dict[str, SaturationDecision]:
    """Saturation for every route whose bounded load tightens when its replicas are
    saturated (``sessionAffinity.saturatedHashBalanceFactor``): route cluster name
    (``policy/route``) -> decision, from the batch fill of the route's first-tier replicas.
    A ``capacityBound`` route's decision is its rung of bounded load, or the two fixed bounds'
    decision at batches too small for the ladder (``decide_capacity_route``)."""
    out: dict[str, SaturationDecision] = {}
    for policy_name in sorted(state.policies):
        for route in state.policies[policy_name].spec.routes:
            affinity = route.session_affinity
            if affinity is None:
                continue
            name = cluster_name(policy_name, route.name)
            if affinity.capacity_bound and route.balancing == "telemetry":
                endpoints, telemetry, max_age = _first_tier(state, route)
                saturated_at = (
                    saturated_fill(affinity.hash_balance_factor)
                    if affinity.saturated_hash_balance_factor
                    else None
                )
                records = sized_records(endpoints, telemetry, now=state.now, max_age=max_age)
                out[name] = decide_capacity_route(
                    state.previous_saturation.get(name),
                    mean_in_flight(records),
                    mean_fill(records),
                    now=state.now,
                    ladder=affinity.ladder(),
                    usual=affinity.hash_balance_factor,
                    saturated_at=saturated_at,
                    replicas=len(records),
                )
                continue
            if not affinity.saturated_hash_balance_factor:
                continue
            endpoints, telemetry, max_age = _first_tier(state, route)
            out[name] = decide_saturation(
                state.previous_saturation.get(name),
                batch_fill(endpoints, telemetry, now=state.now, max_age=max_age),
                now=state.now,
                bound=saturated_fill(affinity.hash_balance_factor),
            )
    return out


def overflow_decisions(state: PolicyState) -> dict[str, OverflowDecision]:
    """The paid share of every route with ``overflow``: route cluster name (``policy/route``)
    -> decision, from the telemetry of the route's first-tier replicas and the paid pools
    resting after a 429."""
    out: dict[str, OverflowDecision] = {}
    for policy_name in sorted(state.policies):
        for route in state.policies[policy_name].spec.routes:
            overflow = route.overflow
            if overflow is None:
                continue
            endpoints, telemetry, max_age = _first_tier(state, route)
            name = cluster_name(policy_name, route.name)
            signals = overflow_signals(
                overflow, endpoints, telemetry, now=state.now, max_age=max_age
            )
            providers = [
                pool
                for pool in provider_order(overflow, state.pools)
                if is_external(state.pools[pool])
            ]
            if overflow.signal == "arrivals":
                out[name] = _by_arrivals(
                    state,
                    name,
                    overflow,
                    _owned_pools(state, route),
                    (endpoints, telemetry, max_age),
                    signals,
                    providers,
                )
                continue
            out[name] = decide_overflow(
                state.previous_overflow.get(name),
                overflow,
                signals,
                providers,
                state.provider_backoff,
                now=state.now,
            )
    return out


def _by_arrivals(
    state: PolicyState,
    name: str,
    overflow: Overflow,
    pools: Sequence[str],
    tier: tuple[Sequence[Endpoint], Mapping[str, TelemetryRecord], float],
    signals: tuple[Signal, ...],
    providers: Sequence[str],
) -> OverflowDecision:
    """The decision of a route with ``overflow.signal: arrivals`` (``signals.overflowff``):
    its demand (every replica's arrival rates), its first tier's batch slots and mean running
    share and waiting requests from fresh telemetry, and what those replicas completed and
    how long they took; and, where responses carry usage, each replica's fullness, the work
    it completed and the route's work by kind (``xdsserver.work``). A route whose prefill fit
    is fresh continues from the one stored for `pools` at their batch size
    (``signals.prefillrecord.seeded``)."""
    endpoints, telemetry, max_age = tier
    fresh = sized_records(endpoints, telemetry, now=state.now, max_age=max_age)
    slots = sum(batch for _, batch in fresh)
    running = (
        sum((record.running or 0.0) / batch for record, batch in fresh) / len(fresh)
        if fresh
        else None
    )
    keys = [endpoint.key for endpoint in endpoints]
    times = [state.service_times[key] for key in keys if key in state.service_times]
    done = [state.recent_completions[key] for key in keys if key in state.recent_completions]
    completed = [state.completions[key] for key in keys if key in state.completions]
    # In work (signals.overflowff): each replica's fullness, the work it computed at its last
    # scrape and the work its responses carried, a prefilled token at the route's weight or
    # the one learned from the engines so far (signals.prefillfit; the decision weighs with
    # the same one).
    previous = state.previous_overflow.get(name)
    before = previous.arrivals if previous is not None else None
    scope = fit_scope(pools, [batch for _, batch in fresh])
    fit = seeded(
        before.fit if before is not None else PrefillFit(),
        state.stored_fits.get(name),
        scope,
        state.now,
    )
    weight = route_weight(fit, overflow.prefill_weight)

    def per_output(key: str) -> float | None:
        prefill = state.prefill_per_output.get(key)
        return None if prefill is None else round(1.0 + weight * prefill, 4)

    replicas = [
        ReplicaLoad(
            key=endpoint.key,
            slots=record.max_running,
            running=(record.running or 0.0) / record.max_running,
            work=recent.at(weight) if (recent := state.recent_work.get(endpoint.key)) else None,
            rate=computed_rate(record.output_tokens_per_second, per_output(endpoint.key)),
            at=record.at,
            total=record.output_tokens_total,
            per_output=per_output(endpoint.key),
            prefilled=record.prefilled_tokens_total,
            steps=record.steps_total,
            engines=record.engines or 1,
        )
        for endpoint in endpoints
        if (record := telemetry.get(endpoint.key)) is not None
        and record.max_running
        and state.now - record.at <= max_age
    ]
    work = [state.completed_work[key].at(weight) for key in keys if key in state.completed_work]
    return decide_overflow_arrivals(
        previous,
        overflow,
        signals,
        providers,
        state.provider_backoff,
        # Every replica's rate (16 s, shared through etcd), or this replica's own over the
        # last 4 s when it is above it beyond noise: a rise counts within seconds.
        demand=blend_demand(route_demand(state.arrivals, name), state.recent_demands.get(name))
        or None,
        slots=slots,
        running=running,
        completions=sum(done) if done else None,
        service_time=sum(times) / len(times) if times else None,
        session_share=state.session_shares.get(name),
        now=state.now,
        completed=sum(completed) if completed else None,
        queued=sum(record.waiting or 0.0 for record, _ in fresh) if fresh else None,
        recent=state.recent_demands.get(name),
        replicas=replicas,
        kinds=state.kind_work.get(name),
        completed_work=sum(work) if work else None,
        fit=fit,
        scope=scope,
    )
