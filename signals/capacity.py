"""What each priced pool costs over a window: a paid pool its tokens at its per-token price,
an owned pool its replicas' hours at the replica-hour price, with the effective price per
million tokens that follows from what it served and the share of its cost that bought idle
capacity. Pure; ``api.spend`` shows it, and cost-aware routing can read it.

Owned capacity is costed from the pool's replica count now (healthy and degraded endpoints)
times the time elapsed in the window: a pool that grew or shrank during the window is costed
as if it had today's size throughout. Utilization is measured, not assumed: the mean over the
pool's replicas of running requests over their batch limit (vLLM's ``num_requests_running``
and the batch size), or their KV-cache use where the limit is not exported; None when the pool
reports no telemetry, and then no idle cost is claimed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from signals.spend import MILLION, Spend, SpendKey
from signals.state import PolicyState, pool_endpoints


@dataclass(frozen=True, slots=True)
class PoolCost:
    """One priced pool over one window."""

    pool: str
    currency: str
    kind: str
    """``tokens`` (paid per token) or ``replicas`` (owned, per replica-hour)."""
    tokens: int
    cost: Decimal
    replicas: int = 0
    hourly: Decimal = Decimal(0)
    """What the pool costs per hour now (owned pools)."""
    utilization: float | None = None
    idle_cost: Decimal | None = None

    @property
    def per_million(self) -> Decimal | None:
        """The effective price per million tokens served (None before any token)."""
        if not self.tokens:
            return None
        return (self.cost * MILLION / self.tokens).quantize(Decimal("0.000001"))

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "pool": self.pool,
            "currency": self.currency,
            "kind": self.kind,
            "tokens": self.tokens,
            "cost": str(self.cost),
            "perMillionTokens": None if self.per_million is None else str(self.per_million),
        }
        if self.kind == "replicas":
            body |= {
                "replicas": self.replicas,
                "hourly": str(self.hourly),
                "utilization": self.utilization,
                "idleCost": None if self.idle_cost is None else str(self.idle_cost),
            }
        return body


def utilization(state: PolicyState, pool: str) -> float | None:
    """The pool's measured utilization now, 0 to 1 (module docstring); None without data."""
    shares = []
    for record in state.telemetry.get(pool, {}).values():
        if record.running is not None and record.max_running:
            shares.append(min(1.0, record.running / record.max_running))
        elif record.kv_cache is not None:
            shares.append(min(1.0, record.kv_cache))
    return sum(shares) / len(shares) if shares else None


def pool_costs(
    state: PolicyState, rows: Mapping[SpendKey, Spend], elapsed: float | None
) -> list[PoolCost]:
    """Every priced pool's cost in a window whose first ``elapsed`` seconds have passed
    (None: all time, where owned pools have no cost, having no start)."""
    tokens: dict[str, int] = {}
    paid: dict[str, Decimal] = {}
    for key, spend in rows.items():
        tokens[key.pool] = tokens.get(key.pool, 0) + spend.tokens
        paid[key.pool] = paid.get(key.pool, Decimal(0)) + spend.cost
    out = []
    for name, pool in sorted(state.pools.items()):
        price = pool.spec.price
        if price is None:
            continue
        if price.replica_hour is None:
            out.append(
                PoolCost(
                    name, price.currency, "tokens", tokens.get(name, 0), paid.get(name, Decimal(0))
                )
            )
            continue
        serving = [
            endpoint
            for endpoint in pool_endpoints(pool, state.registered.get(name, {}))
            if endpoint.health in ("healthy", "degraded")
        ]
        replicas = len(serving)
        # Each replica at the price of its capacity kind (spot, on-demand, ...).
        hourly = sum((price.replica_price(e.capacity) or Decimal(0) for e in serving), Decimal(0))
        cost = (
            (hourly * Decimal(str(round(elapsed, 3))) / 3600).quantize(Decimal("0.000001"))
            if elapsed is not None
            else Decimal(0)
        )
        busy = utilization(state, name)
        idle = (
            (cost * Decimal(str(round(1 - busy, 4)))).quantize(Decimal("0.000001"))
            if busy is not None
            else None
        )
        out.append(
            PoolCost(
                name,
                price.currency,
                "replicas",
                tokens.get(name, 0),
                cost,
                replicas=replicas,
                hourly=hourly,
                utilization=busy,
                idle_cost=idle,
            )
        )
    return out
