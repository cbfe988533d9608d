"""Budgets: which tenants have spent their window's budget, and what that means for each
route. Pure: ``controlplane.budgets`` feeds in the fleet's spend and hands the verdicts to the
reconciler as ``PolicyState.over_budget``; compile puts them on the routes.

How late a verdict can be, and so how far a tenant can overshoot, is in docs/cost.md: spend
past the budget is at most the tenant's rate times the lag (Envoy's access log flush, this
check, the reconciler's debounce, the push), plus what the tenant had in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from decimal import Decimal

from policies.models import Budget
from policies.plan import PlanBudgetBlock, PlanRoute
from policies.spend import Spend, SpendKey, Window, window_bounds


def applies(budget: Budget, key: SpendKey) -> bool:
    """True when the budget counts this row's spend."""
    spec = budget.spec
    return (
        key.tenant == spec.tenant
        and (spec.service_class is None or key.service_class == spec.service_class)
        and (spec.model is None or key.model == spec.model)
    )


def budget_spend(budget: Budget, rows: Mapping[SpendKey, Spend]) -> tuple[int, Decimal]:
    """The window's tokens and the money in the budget's currency that count against it."""
    tokens, amount = 0, Decimal(0)
    for key, spend in rows.items():
        if applies(budget, key):
            tokens += spend.tokens
            if key.currency == budget.spec.currency:
                amount += spend.cost
    return tokens, amount


def is_spent(budget: Budget, rows: Mapping[SpendKey, Spend]) -> bool:
    tokens, amount = budget_spend(budget, rows)
    spec = budget.spec
    if spec.tokens is not None:
        return tokens >= spec.tokens
    return spec.amount is not None and amount >= spec.amount


def over_budgets(
    budgets: Mapping[str, Budget],
    spend: Callable[[Window], Mapping[SpendKey, Spend]],
    at: float,
) -> dict[str, float]:
    """Budget name -> the end of its window, for every budget its tenant has spent."""
    out: dict[str, float] = {}
    rows: dict[Window, Mapping[SpendKey, Spend]] = {}
    for name, budget in sorted(budgets.items()):
        window = budget.spec.window
        if window not in rows:
            rows[window] = spend(window)
        if is_spent(budget, rows[window]):
            out[name] = window_bounds(window, at)[1].timestamp()
    return out


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
