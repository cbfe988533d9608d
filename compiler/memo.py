"""Reuse a compiled route while every input it reads is unchanged: a route is compiled
again (``compiler.routes``) only when it or one of the objects it reads is new."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from compiler.models import PoolModels
from compiler.plan import Diagnostic, PlanCluster, PlanRoute
from compiler.routes import compile_route, route_diagnostics
from policies.models import Route, RoutingPolicy
from policies.names import cluster_name
from signals.admission import AdmissionDecision
from signals.overflow import OverflowDecision
from signals.state import PolicyState
from signals.weights import WeightDecision


@dataclass(frozen=True, slots=True)
class MemoEntry:
    inputs: tuple[object, ...]
    diagnostics: list[Diagnostic]
    clusters: list[PlanCluster]
    route: PlanRoute


class RouteMemo:
    """What `compile_plan` built for each route last time, and the objects it read to build it.

    A route is compiled again only when it changed, or when one of its other inputs is not the
    very object it was last time: for each pool it names the pool, its registered endpoints and its
    telemetry weights. Callers that keep unchanged objects (the reconciler's decoded state
    replaces a pool's endpoint mapping only when one of them changes) pay for what changed, not
    for the fleet; an endpoint change recompiles the routes of its pool alone, and the plan's
    other clusters stay the same objects, which translation compares by identity first. Inputs
    are held, so an identity is never that of a collected object.
    """

    def __init__(self) -> None:
        self._entries: dict[str, MemoEntry] = {}

    def route(
        self,
        policy: RoutingPolicy,
        index: int,
        route: Route,
        state: PolicyState,
        weights: Mapping[str, Mapping[str, WeightDecision]],
        admission: AdmissionDecision | None = None,
        *,
        saturated: bool = False,
        served: Mapping[str, PoolModels] | None = None,
        overflow: OverflowDecision | None = None,
        bound: int = 0,
        gate: int | None,
    ) -> MemoEntry:
        """The compiled route, reused when its inputs are unchanged."""
        route_weights = weights if route.balancing == "telemetry" else {}
        names = [target.pool for tier in route.tiers for target in tier.pools]
        route_served = tuple((served or {}).get(name) for name in names)
        if route.overflow is not None:
            names += route.overflow.pools
        inputs = (
            (
                route,
                policy.spec.service_classes,
                admission,
                saturated,
                route_served,
                overflow,
                bound,
                gate,
            ),
            index,
            *(state.pools.get(name) for name in names),
            *(state.registered.get(name) for name in names),
            *(route_weights.get(name) for name in names),
        )
        name = cluster_name(policy.metadata.name, route.name)
        entry = self._entries.get(name)
        if (
            entry is not None
            and len(entry.inputs) == len(inputs)
            # The route, its policy's service classes, admission, saturation and what its
            # pools serve are small, and a policy edit makes them all new objects (telemetry
            # makes new served models on every record): compare them by value; the rest is
            # large and compared by identity.
            and entry.inputs[0] == inputs[0]
            and all(a is b for a, b in zip(entry.inputs[1:], inputs[1:], strict=True))
        ):
            return entry
        clusters, plan_route = compile_route(
            policy,
            route,
            state,
            weights,
            admission,
            saturated=saturated,
            served=served,
            overflow=overflow,
            bound=bound,
            gate=gate,
        )
        return MemoEntry(
            inputs, route_diagnostics(policy, index, route, state), clusters, plan_route
        )

    def keep(self, entries: dict[str, MemoEntry]) -> None:
        """Remember exactly this compile's routes (dropping the ones that are gone)."""
        self._entries = entries
