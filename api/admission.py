"""The console's view of service classes: per route and class, what kvpilot admits now, why,
and since when (``GET /v1/admission``).

Admission is decided each round from telemetry (``signals.admission``) and travels to Envoy
in RDS; this view shows the decision the served plan holds, beside what it was made from: the
route's pressure signals against their bounds and the hysteresis band. kvpilot does not count
requests itself, so each class names the Envoy counters that do (admitted, shed, diverted,
queued), for ``/stats`` on an Envoy or the Prometheus scrape of it.
"""

from __future__ import annotations

import math
from typing import Any

from compiler import RoutingPlan
from compiler.plan import PlanClass, PlanRoute
from policies.models import RoutingPolicy, ServiceClass, ServiceClasses
from policies.names import cluster_name
from signals import PolicyState
from signals.admission import AdmissionDecision, steps_per_class
from xdsserver.translate.classes import admission_runtime_key, class_stats

RESTRICTED_STATE = {"shed": "shed", "divert": "diverted", "queue": "queued"}
"""What a fully restricted class's requests become, by its action."""


def _time(value: float) -> float | None:
    """A wall-clock time for JSON: None for "never" (an infinite sentinel)."""
    return value if math.isfinite(value) else None


def class_state(action: str, admitted: float) -> str:
    """``admitted`` (all of it), ``restricted`` (part shed, diverted or queued), or what all
    of it becomes now: ``shed``, ``diverted`` or ``queued``."""
    if action == "admit" or admitted >= 1.0:
        return "admitted"
    return RESTRICTED_STATE[action] if admitted <= 0.0 else "restricted"


def _saturation(classes: ServiceClasses) -> dict[str, Any]:
    """The saturation bounds, in seconds as numbers (the python mode, not the "1s" strings of
    the JSON mode); ``ttft`` is the bound in force, also when it comes from the most
    important class's objective."""
    return {**classes.saturation.model_dump(by_alias=True), "ttft": classes.ttft_bound}


def _plan_routes(plan: RoutingPlan) -> dict[str, tuple[str, PlanRoute]]:
    """Every compiled route by name (``policy/route``), with its virtual host's name; a route
    served to several fleets is compiled alike for each, so the first one found stands."""
    out: dict[str, tuple[str, PlanRoute]] = {}
    for fleet in plan.fleets:
        for listener in fleet.listeners:
            for vhost in listener.virtual_hosts:
                for route in vhost.routes:
                    out.setdefault(route.name, (vhost.name, route))
    return out


def _class_view(
    service_class: ServiceClass,
    plan_class: PlanClass,
    *,
    fallback: bool,
    vhost: str,
    route: PlanRoute,
    decision: AdmissionDecision,
) -> dict[str, Any]:
    admitted = plan_class.admitted
    since = (decision.since or {}).get(plan_class.name, -math.inf)
    restrictable = plan_class.action != "admit"
    return {
        "name": plan_class.name,
        "objective": {"ttft": service_class.objective.ttft},
        "whenSaturated": plan_class.action,
        "divertTo": service_class.divert_to if plan_class.action == "divert" else None,
        "retryAfter": plan_class.retry_after if plan_class.action == "shed" else None,
        "queue": service_class.queue.model_dump(by_alias=True)
        if service_class.queue is not None
        else None,
        "budget": service_class.budget.model_dump(by_alias=True, exclude_none=True)
        if service_class.budget is not None
        else None,
        "match": None
        if fallback
        else {
            "headers": [list(h) for h in plan_class.headers],
            "tenants": list(plan_class.tenants),
        },
        "fallback": fallback,
        "admitted": admitted,
        "state": class_state(plan_class.action, admitted),
        "since": _time(since),
        "runtimeKey": admission_runtime_key(route, plan_class) if restrictable else None,
        "stats": class_stats(vhost, route, plan_class),
    }


def _route_view(
    policy: RoutingPolicy,
    index: int,
    compiled: tuple[str, PlanRoute] | None,
    decision: AdmissionDecision,
) -> dict[str, Any]:
    route = policy.spec.routes[index]
    classes = policy.spec.service_classes
    assert classes is not None
    by_name = {c.name: c for c in classes.classes}
    importance = {name: i for i, name in enumerate(by_name)}
    shown: list[dict[str, Any]] = []
    if compiled is not None:
        vhost, plan_route = compiled
        # Envoy tries the classes with a match first, then the route's fallback class; shown
        # most important first, as they are declared and restricted.
        fallback = plan_route.classes[-1].name if plan_route.classes else None
        for plan_class in sorted(plan_route.classes, key=lambda c: importance[c.name]):
            shown.append(
                _class_view(
                    by_name[plan_class.name],
                    plan_class,
                    fallback=plan_class.name == fallback,
                    vhost=vhost,
                    route=plan_route,
                    decision=decision,
                )
            )
    restricted = [c for c in classes.classes if c.when_saturated != "admit"]
    next_step = (
        {"direction": decision.next_step, "at": decision.next_step_at}
        if decision.next_step is not None and math.isfinite(decision.next_step_at)
        else None
    )
    return {
        "name": route.name,
        "route": cluster_name(policy.metadata.name, route.name),
        "compiled": compiled is not None,
        "pools": [target.pool for target in route.tiers[0].pools if target.weight > 0],
        "pressure": decision.pressure,
        "signals": [
            {
                "name": signal.name,
                "mean": round(signal.mean, 6),
                "bound": signal.bound,
                "pressure": signal.pressure,
            }
            for signal in decision.signals
        ],
        "level": decision.level,
        "levels": len(restricted) * steps_per_class(classes.saturation),
        "changedAt": _time(decision.changed_at),
        "nextStep": next_step,
        "classes": shown,
    }


def admission_view(state: PolicyState | None, plan: RoutingPlan | None) -> list[dict[str, Any]]:
    """Every RoutingPolicy with service classes: its saturation bounds and hysteresis band,
    and per route the pressure, the decision and each class's state; pure."""
    if state is None or plan is None:
        return []
    compiled = _plan_routes(plan)
    policies = []
    for name in sorted(state.policies):
        policy = state.policies[name]
        classes = policy.spec.service_classes
        if classes is None:
            continue
        routes = []
        for index, route in enumerate(policy.spec.routes):
            key = cluster_name(name, route.name)
            decision = plan.admission.get(key) or AdmissionDecision()
            routes.append(_route_view(policy, index, compiled.get(key), decision))
        policies.append(
            {
                "name": name,
                "tenantHeader": classes.tenant_header,
                "defaultClass": classes.default,
                "saturation": _saturation(classes),
                "routes": routes,
            }
        )
    return policies


def restricted_classes(plan: RoutingPlan | None) -> list[dict[str, Any]]:
    """The classes not fully admitted right now, per route, for the status summary (the
    console's header shows them on every view); pure."""
    if plan is None:
        return []
    out = []
    for name, (_, route) in sorted(_plan_routes(plan).items()):
        for plan_class in route.classes:
            state = class_state(plan_class.action, plan_class.admitted)
            if state != "admitted":
                out.append(
                    {
                        "route": name,
                        "class": plan_class.name,
                        "state": state,
                        "admitted": plan_class.admitted,
                    }
                )
    return out
