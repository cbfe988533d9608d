"""Budgets: which tenants have spent their window's budget. Pure: ``controlplane.reconcile.budgets``
feeds in the fleet's spend and hands the verdicts to the reconciler as
``PolicyState.over_budget``; ``compiler.budgets`` puts them on the routes.

How late a verdict can be, and so how far a tenant can overshoot, is in docs/cost.md: spend
past the budget is at most the tenant's rate times the lag (Envoy's access log flush, this
check, the reconciler's debounce, the push), plus what the tenant had in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal

from policies.models import Budget
from signals.spend import Spend, SpendKey, Window, window_bounds


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
