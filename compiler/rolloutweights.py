"""What a rollout step writes into its RoutingPolicy: the target tier's pool weights, and the
weights its canary fleets get instead while a step reaches only them (``fleetWeights``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies import Rollout, RoutingPolicy


def policy_with(
    rollout: Rollout,
    policy: RoutingPolicy,
    weights: Mapping[str, int],
    canary_weights: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The policy body with the target tier's pools set to ``weights``, and to
    ``canary_weights`` in the rollout's canary fleets (None: the same in every fleet)."""
    body = policy.model_dump(mode="json", by_alias=True)
    target = rollout.spec.target
    for route in body["spec"]["routes"]:
        if route["name"] != target.route:
            continue
        tier = route["tiers"][target.tier]
        present = {entry["pool"] for entry in tier["pools"]}
        for entry in tier["pools"]:
            if entry["pool"] in weights:
                entry["weight"] = weights[entry["pool"]]
        for pool in [*weights, *(canary_weights or {})]:
            if pool not in present:
                tier["pools"].append({"pool": pool, "weight": weights.get(pool, 0)})
                present.add(pool)
        # Always written: the body is the policy as stored, so a step for every fleet must
        # replace the canary fleets' weights of the step before with none. An empty map is
        # what every stored tier carries anyway (the API stores the full model).
        tier["fleetWeights"] = (
            {}
            if canary_weights is None
            else {fleet: dict(canary_weights) for fleet in rollout.spec.fleets}
        )
    return body


def tier_weights(rollout: Rollout, policy: RoutingPolicy) -> dict[str, int]:
    target = rollout.spec.target
    route = next(r for r in policy.spec.routes if r.name == target.route)
    current = {t.pool: t.weight for t in route.tiers[target.tier].pools}
    return {pool: current.get(pool, 0) for pool in rollout.spec.pools()}
