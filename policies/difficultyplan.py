"""Compile a policy's virtual models into the plan: the scorer, the target models and the
threshold in force (the configured one, or the one kvpilot learned to hold the share)."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from compiler.plan import PlanScorerService, PlanVirtualModel
from policies.difficultyshare import ShareDecision
from policies.models import RoutingPolicy

SCORER_CLUSTER_PREFIX = "difficulty-scorer/"


def virtual_key(policy: str, name: str) -> str:
    """How a virtual model is named in reports, decisions and metrics: ``policy/name``."""
    return f"{policy}/{name}"


def plan_virtual_models(
    policy: RoutingPolicy, decisions: Mapping[str, ShareDecision]
) -> tuple[PlanVirtualModel, ...]:
    """The policy's virtual models, each with the threshold ``decisions`` holds for it (those
    with a share), else its configured threshold."""
    out = []
    for virtual in policy.spec.virtual_models:
        key = virtual_key(policy.metadata.name, virtual.name)
        decision = decisions.get(key) if virtual.share is not None else None
        scorer = virtual.scorer
        service = None
        if scorer.type == "external" and scorer.external is not None:
            parts = urlsplit(scorer.external.url)
            service = PlanScorerService(
                cluster=SCORER_CLUSTER_PREFIX + key,
                host=parts.hostname or "",
                port=parts.port or 80,
                path=(parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                timeout=scorer.external.timeout,
                fallback_large=scorer.external.fallback == "large",
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
            )
        )
    return tuple(out)
