"""Budget blocks on routes: for every budget its tenant has spent (the verdicts in
``PolicyState.over_budget``, from ``signals.budgets``), the route entries that turn the
tenant's requests away or divert them, and what the client reads."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from compiler.plan import PlanBudgetBlock, PlanRoute
from policies.models import Budget


def block_message(budget: Budget, reset_at: int) -> str:
    """What a client past its budget reads (the OpenAI error's ``message``)."""
    spec = budget.spec
    limit = f"{spec.tokens} tokens" if spec.tokens is not None else f"{spec.amount} {spec.currency}"
    scope = "".join(
        (
            f" for class {spec.service_class!r}" if spec.service_class else "",
            f" for model {spec.model!r}" if spec.model else "",
        )
    )
    reset = datetime.fromtimestamp(reset_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (
        f"Tenant {spec.tenant!r} has spent its budget {budget.metadata.name!r} of {limit} per "
        f"{spec.window}{scope}; it resets at {reset} (see Retry-After)."
    )


def route_blocks(
    route: PlanRoute,
    budgets: Mapping[str, Budget],
    over: Mapping[str, float],
    route_clusters: Mapping[str, str],
) -> tuple[PlanBudgetBlock, ...]:
    """The blocks of one route: every spent budget whose class and model the route can tell
    (a class with a match of its own, a model the route selects by). ``route_clusters``: the
    clusters of the routes of the same policy, by route name, for ``divertTo``."""
    blocks = []
    selecting = {c.name for c in route.classes if c.headers or c.tenants}
    for name in sorted(over):
        budget = budgets.get(name)
        if budget is None:
            continue
        spec = budget.spec
        if spec.service_class is not None and spec.service_class not in selecting:
            continue
        if spec.model is not None and spec.model not in route.models:
            continue
        divert = ""
        if spec.action == "divert":
            divert = route_clusters.get(spec.divert_to or "", "")
            if not divert or divert == route.cluster:
                continue  # nothing cheaper here: the route keeps serving (docs/cost.md)
        reset_at = int(over[name])
        blocks.append(
            PlanBudgetBlock(
                budget=name,
                tenant=spec.tenant,
                service_class=spec.service_class or "",
                model=spec.model or "",
                reset_at=reset_at,
                message=block_message(budget, reset_at),
                divert_cluster=divert,
            )
        )
    return tuple(blocks)
