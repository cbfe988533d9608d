"""What a virtual model saved against sending everything to its large model.

Per virtual model: its requests' tokens priced at the pools that served them (the spend
ledger's cost, counted at the price in force when each response arrived) against the same
tokens priced at the large model's per-token price (the price in force now). The large
model's price is that of the pools in the first tier of the route that serves it: where its
requests go while that tier has capacity.

A saving is stated only where both sides are per-token prices in one currency. A pool priced
per replica-hour (capacity you own) costs its hours whether it serves a token or not, so its
tokens have no price to compare (docs/difficulty.md: spend saved); currencies are never
converted. In those cases the saving is None and ``reason`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from policies.models import RoutingPolicy, VirtualModel
from signals.spend import Spend, SpendKey, TokenPrice, token_price
from signals.state import PolicyState


@dataclass(frozen=True, slots=True)
class Saving:
    """One virtual model's spend and the spend it avoided."""

    virtual_model: str
    """``policy/name``."""
    large: str
    """The large target model."""
    usage: Spend
    """Requests and tokens counted for the virtual model, and their cost where priced."""
    currency: str = ""
    """The one currency of both sides; empty when no saving is stated."""
    large_cost: Decimal | None = None
    """What the same tokens would have cost at the large model's price."""
    reason: str = ""
    """Why no saving is stated (empty when one is)."""

    @property
    def saved(self) -> Decimal | None:
        """Large cost less the cost at the serving pools' prices; None when not comparable."""
        return None if self.large_cost is None else self.large_cost - self.usage.cost

    def as_json(self) -> dict[str, Any]:
        saved = self.saved
        return {
            "requests": self.usage.requests,
            "tokens": self.usage.tokens,
            "currency": self.currency or None,
            "cost": str(self.usage.cost) if saved is not None else None,
            "largeCost": str(self.large_cost) if self.large_cost is not None else None,
            "saved": str(saved) if saved is not None else None,
            "reason": self.reason or None,
        }


def large_price(
    state: PolicyState, policy: RoutingPolicy, virtual: VirtualModel
) -> TokenPrice | str:
    """The large model's per-token price, or why there is none: the price of the pools in the
    first tier of the policy's route that serves it, which must agree."""
    route = next((r for r in policy.spec.routes if virtual.large in r.match.models), None)
    if route is None or not route.tiers:
        return f"no route serves {virtual.large!r}"
    pools = [target.pool for target in route.tiers[0].pools]
    prices = {
        name: token_price(p.spec.price) if (p := state.pools.get(name)) else None for name in pools
    }
    unpriced = sorted(name for name, price in prices.items() if price is None)
    if unpriced:
        return f"pool {unpriced[0]!r} of the large model {virtual.large!r} has no per-token price"
    distinct = set(prices.values())
    if len(distinct) > 1:
        return f"the pools of the large model {virtual.large!r} have different prices"
    price = distinct.pop()
    assert price is not None
    return price


def saving(key: str, large: str, rows: Mapping[SpendKey, Spend], price: TokenPrice | str) -> Saving:
    """The saving of virtual model ``key`` from spend ``rows`` (any rows; its own are taken)
    against ``price``, the large model's price or why it has none."""
    own = [(k, spend) for k, spend in rows.items() if k.virtual_model == key]
    usage = Spend()
    for _, spend in own:
        usage.add(spend)
    if isinstance(price, str):
        return Saving(key, large, usage, reason=price)
    unpriced = sorted({k.pool for k, _ in own if not k.currency})
    if unpriced:
        pool = unpriced[0]
        what = f"pool {pool!r}" if pool else "a host of no known pool"
        return Saving(key, large, usage, reason=f"{what} served it without a per-token price")
    currencies = sorted({k.currency for k, _ in own} | {price.currency})
    if len(currencies) > 1:
        return Saving(
            key,
            large,
            usage,
            reason=f"served in {' and '.join(currencies)}; currencies are never converted",
        )
    large_cost = sum(
        (price.cost(s.prompt_tokens, s.cached_tokens, s.completion_tokens) for _, s in own),
        Decimal(0),
    )
    return Saving(key, large, usage, currency=price.currency, large_cost=large_cost)


def virtual_savings(state: PolicyState, rows: Mapping[SpendKey, Spend]) -> dict[str, Saving]:
    """Every virtual model of ``state``, ``policy/name`` -> its saving from spend ``rows``."""
    out: dict[str, Saving] = {}
    for name, policy in sorted(state.policies.items()):
        for virtual in policy.spec.virtual_models:
            key = f"{name}/{virtual.name}"
            out[key] = saving(key, virtual.large, rows, large_price(state, policy, virtual))
    return out
