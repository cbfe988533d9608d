"""The console's view of virtual models (``GET /v1/virtualmodels``): per virtual model its
targets and scorer, the threshold in force and the share it aims at, and what Envoys reported
to this replica: requests by target (the large model's share), where scores came from, how
often the cap or floor overrode them, escalations and the score distribution; and, from every
replica's spend, what its requests cost against the same tokens at the large model's price
(``signals.savings``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compiler import RoutingPlan
from compiler.difficulty import virtual_key
from compiler.plan import PlanVirtualModel
from signals import PolicyState
from signals.difficultyshare import ShareDecision
from signals.savings import Saving
from xdsserver.difficultylog import VirtualModelCounts


def _planned(plan: RoutingPlan | None) -> dict[str, PlanVirtualModel]:
    out: dict[str, PlanVirtualModel] = {}
    for fleet in plan.fleets if plan is not None else ():
        for listener in fleet.listeners:
            for vhost in listener.virtual_hosts:
                for virtual in vhost.virtual_models:
                    out.setdefault(virtual.key, virtual)
    return out


def virtual_models_view(
    state: PolicyState | None,
    plan: RoutingPlan | None,
    counts: Mapping[str, VirtualModelCounts],
    decisions: Mapping[str, ShareDecision],
    savings: Mapping[str, Saving] | None = None,
) -> list[dict[str, Any]]:
    """One entry per virtual model of the served state; ``decisions``: the share loop's
    latest (its threshold is the served one once the plan is rebuilt); ``savings``: its spend
    against the large model's price (``signals.savings.virtual_savings``)."""
    planned = _planned(plan)
    out = []
    for policy_name in sorted(state.policies if state is not None else {}):
        policy = state.policies[policy_name]  # type: ignore[union-attr]
        for virtual in policy.spec.virtual_models:
            key = virtual_key(policy_name, virtual.name)
            served = planned.get(key)
            decision = decisions.get(key)
            seen = counts.get(key, VirtualModelCounts())
            total = sum(seen.targets.values())
            served_thresholds = (
                [*(step.threshold for step in served.steps), served.threshold]
                if served is not None
                else []
            )
            configured = virtual.steps
            target_models = [{"model": virtual.models[0], "share": None, "threshold": None}]
            for index, step in enumerate(configured):
                share = virtual.targets[index + 1].share if virtual.targets else virtual.share
                target_models.append(
                    {
                        "model": step.model,
                        "share": share,
                        "threshold": served_thresholds[index]
                        if len(served_thresholds) == len(configured)
                        else step.threshold,
                    }
                )
            out.append(
                {
                    "key": key,
                    "policy": policy_name,
                    "name": virtual.name,
                    "small": virtual.small,
                    "large": virtual.large,
                    "targetModels": target_models,
                    "scorer": virtual.scorer.type,
                    "share": virtual.share,
                    "cap": virtual.cap_percent,
                    "floor": virtual.floor_percent,
                    "escalation": virtual.escalation is not None,
                    "threshold": served.threshold if served is not None else virtual.threshold,
                    "tie": served.tie if served is not None else 0.0,
                    "expectedShare": decision.expected if decision is not None else None,
                    "samples": decision.samples if decision is not None else 0,
                    "requests": total,
                    "targets": seen.targets,
                    "largeShare": 100 * seen.targets.get(virtual.large, 0) / total
                    if total
                    else None,
                    "sources": seen.sources,
                    "forced": seen.forced,
                    "escalations": seen.escalations,
                    "scores": seen.scores,
                    "spend": savings[key].as_json() if savings and key in savings else None,
                }
            )
    return out
