"""The routing plan and the compiler (no I/O): policy state -> one plan per fleet.

- ``plan``: the plan's plain data (clusters, routes, listeners per fleet, diagnostics);
- ``compile``: ``compile_plan``, best effort (a bad route is a diagnostic, the rest ships);
- ``routes``: one route's clusters and classes, memoised; ``fleets``: per-fleet policy views;
- ``rollout``: a Rollout's references, signals and verdicts; ``rolloutweights``: the weights
  a rollout step writes into its RoutingPolicy; ``budgets``: the route entries of tenants
  past a budget.
"""

from compiler.compile import RouteMemo, compile_plan
from compiler.plan import DEFAULT_FLEET, Diagnostic, FleetPlan, RoutingPlan

__all__ = [
    "DEFAULT_FLEET",
    "Diagnostic",
    "FleetPlan",
    "RouteMemo",
    "RoutingPlan",
    "compile_plan",
]
