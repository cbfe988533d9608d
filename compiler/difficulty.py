"""Compile a policy's virtual models into the plan: the scorer, the target models and the
threshold in force (the configured one, or the one kvpilot learned to hold the share)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from compiler.plan import (
    PlanCluster,
    PlanEscalation,
    PlanRoute,
    PlanScorerService,
    PlanStep,
    PlanVirtualModel,
)
from policies.models import RoutingPolicy, VirtualModel
from signals.difficultyshare import ShareDecision

SCORER_CLUSTER_PREFIX = "difficulty-scorer/"


def virtual_key(policy: str, name: str) -> str:
    """How a virtual model is named in reports, decisions and metrics: ``policy/name``."""
    return f"{policy}/{name}"


def step_keys(key: str, virtual: VirtualModel) -> list[str]:
    """How the share loop names each target after the first (``VirtualModel.steps``): the
    last by the virtual model's key, as with two targets; the others ``key@model``."""
    steps = virtual.steps
    return [
        key if index == len(steps) - 1 else f"{key}@{step.model}"
        for index, step in enumerate(steps)
    ]


ESCALATION_CLUSTER_PREFIX = "difficulty-escalate/"
_RETRY_ON = {
    "5xx": "5xx",
    "reset": "reset",
    "connect-failure": "connect-failure",
    "timeout": "gateway-error",
}


def _escalation(
    key: str,
    virtual: VirtualModel,
    routes: Sequence[PlanRoute],
    clusters: Mapping[str, PlanCluster],
) -> PlanEscalation | None:
    escalation = virtual.escalation
    if escalation is None:
        return None
    small = next((r for r in routes if virtual.small in r.models), None)
    large = next((r for r in routes if virtual.large in r.models), None)
    if small is None or large is None or small.cluster not in clusters:
        return None
    return PlanEscalation(
        cluster=ESCALATION_CLUSTER_PREFIX + key,
        members=(small.cluster, large.cluster),
        protocol=clusters[small.cluster].protocol,
        retry_on=tuple(dict.fromkeys(_RETRY_ON[condition] for condition in escalation.retry_on)),
        per_try_timeout=escalation.timeout,
        timeout=small.timeouts.request,
        idle_timeout=small.timeouts.idle,
        large_hosts=tuple(
            sorted(
                {
                    f"[{e.address}]:{e.port}" if ":" in e.address else f"{e.address}:{e.port}"
                    for e in clusters[large.cluster].endpoints
                }
            )
        )
        if large.cluster in clusters
        else (),
    )


def plan_virtual_models(
    policy: RoutingPolicy,
    decisions: Mapping[str, ShareDecision],
    routes: Sequence[PlanRoute] = (),
    clusters: Sequence[PlanCluster] = (),
) -> tuple[PlanVirtualModel, ...]:
    """The policy's virtual models, each with the threshold ``decisions`` holds for it (those
    with a share), else its configured threshold, and its escalation over the targets'
    route clusters (``routes`` and ``clusters`` compiled from the same policy)."""
    by_name = {cluster.name: cluster for cluster in clusters}
    out = []
    for virtual in policy.spec.virtual_models:
        key = virtual_key(policy.metadata.name, virtual.name)
        learned = virtual.above_share is not None
        decision = decisions.get(key) if learned else None
        steps = []
        for step, step_key in list(zip(virtual.steps, step_keys(key, virtual), strict=True))[:-1]:
            held = decisions.get(step_key) if learned else None
            steps.append(
                PlanStep(
                    model=step.model,
                    threshold=held.threshold if held is not None else step.threshold,
                    tie=held.tie if held is not None else 0.0,
                )
            )
        scorer = virtual.scorer
        service = None
        if scorer.type == "external" and scorer.external is not None:
            parts = urlsplit(scorer.external.url)
            service = PlanScorerService(
                cluster=SCORER_CLUSTER_PREFIX + key,
                host=parts.hostname or "",
                port=parts.port or 80,
                path=(parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                timeout=scorer.external.call_timeout,
                fallback_large=scorer.external.fallback == "large",
                budget=scorer.external.timeout,
            )
        out.append(
            PlanVirtualModel(
                key=key,
                name=virtual.name,
                small=virtual.small,
                large=virtual.large,
                scorer=scorer.type,
                weights=tuple(sorted(scorer.builtin.weights.items())),
                bias=scorer.builtin.bias,
                header=scorer.header,
                threshold=decision.threshold if decision is not None else virtual.threshold,
                tie=decision.tie if decision is not None else 0.0,
                cap=virtual.cap_percent,
                floor=virtual.floor_percent,
                service=service,
                escalation=_escalation(key, virtual, routes, by_name),
                steps=tuple(steps),
            )
        )
    return tuple(out)
