"""`kvpilot get spend`: tokens and their cost per tenant, model and pool (or as grouped), the
priced pools' cost in the window, and the totals per currency."""

from __future__ import annotations

from typing import Any


def spend_rows(view: dict[str, Any]) -> list[list[str]]:
    """The spend table: one row per group and currency, then a TOTAL row per currency."""
    names: list[str] = view["by"]
    rows = [
        [*(name.upper() for name in names), "REQUESTS", "PROMPT", "CACHED", "COMPLETION", "COST"]
    ]
    for row in view["rows"]:
        rows.append(
            [
                *(row[name] or "-" for name in names),
                str(row["requests"]),
                str(row["promptTokens"]),
                str(row["cachedTokens"]),
                str(row["completionTokens"]),
                _money(row["cost"], row["currency"]),
            ]
        )
    for total in view["totals"]:
        rows.append(
            [
                "TOTAL",
                *([""] * (len(names) - 1)),
                str(total["requests"]),
                str(total["promptTokens"]),
                str(total["cachedTokens"]),
                str(total["completionTokens"]),
                _money(total["cost"], total["currency"]),
            ]
        )
    return rows


def pool_cost_rows(view: dict[str, Any]) -> list[list[str]]:
    """The priced pools: what they cost in the window and per million tokens served."""
    rows = [["POOL", "PRICED BY", "TOKENS", "COST", "PER 1M TOKENS", "UTILIZATION", "IDLE COST"]]
    for pool in view.get("pools", []):
        currency = pool["currency"]
        busy = pool.get("utilization")
        rows.append(
            [
                pool["pool"],
                "token" if pool["kind"] == "tokens" else f"replica-hour x{pool['replicas']}",
                str(pool["tokens"]),
                _money(pool["cost"], currency),
                _money(pool["perMillionTokens"], currency),
                "-" if busy is None else f"{busy:.0%}",
                _money(pool.get("idleCost"), currency),
            ]
        )
    return rows


def price_text(price: dict[str, Any] | None) -> str:
    """A pool's price in one cell: ``USD 2.5/10 per 1M`` or ``USD 4.2/replica-hour``."""
    if not price:
        return "-"
    currency = price.get("currency", "USD")
    if price.get("replicaHour") is not None:
        return f"{currency} {price['replicaHour']}/replica-hour"
    cached = f" (cached {price['cachedInput']})" if price.get("cachedInput") is not None else ""
    return f"{currency} {price.get('input')}/{price.get('output')} per 1M{cached}"


def _money(amount: str | None, currency: str) -> str:
    if amount is None:
        return "-"
    return f"{amount} {currency}".strip() if currency else "-"
