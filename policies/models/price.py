"""A Pool's price: per million tokens for a paid provider, or per replica-hour for capacity
the platform owns, in a currency from a fixed list."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, model_validator

from policies.models.fields import Capacity, Model

CURRENCIES = ("AUD", "CAD", "CHF", "CNY", "EUR", "GBP", "INR", "JPY", "USD")
"""ISO 4217 codes kvpilot accepts. Spend is summed per currency and never converted."""


def _parse_money(value: Any) -> Decimal:
    """A non-negative finite decimal from a number or a string ("2.50"); floats go through
    their shortest text (0.15 -> Decimal("0.15"), not its binary expansion)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError('a price is a number, for example 2.5 or "2.50"')
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a number") from None
    if not amount.is_finite():
        raise ValueError(f"{value!r} is not a finite number")
    if amount < 0:
        raise ValueError(f"a price cannot be negative (got {value!r})")
    if amount > Decimal(1_000_000_000):
        raise ValueError(f"{value!r} is larger than any price kvpilot accepts (1e9)")
    return amount


Money = Annotated[
    Decimal,
    BeforeValidator(_parse_money),
    PlainSerializer(lambda d: format(d.normalize(), "f"), return_type=str),
]
"""An amount of money: exact, non-negative, written as a decimal string."""


def _parse_currency(value: Any) -> str:
    if not isinstance(value, str) or value.upper() not in CURRENCIES:
        raise ValueError(
            f"currency {value!r} is not supported: use one of {', '.join(CURRENCIES)} "
            "(ISO 4217 codes)"
        )
    return value.upper()


Currency = Annotated[str, BeforeValidator(_parse_currency)]


class Price(Model):
    """What a pool's capacity costs. A paid provider is priced per token (``input`` and
    ``output``, optionally ``cachedInput``); capacity the platform owns is priced per replica
    and hour (``replicaHour``), and its effective price per token follows how busy it is."""

    currency: Currency = Field("USD", description="ISO 4217 code. Default: USD.")
    input: Money | None = Field(
        None, description="Per million uncached prompt tokens. Default: none."
    )
    cached_input: Money | None = Field(
        None,
        description="Per million prompt tokens served from the provider's prompt cache "
        "(usage.prompt_tokens_details.cached_tokens). Default: the input price.",
    )
    output: Money | None = Field(None, description="Per million completion tokens. Default: none.")
    replica_hour: Money | None = Field(
        None, description="Per replica and hour, for owned capacity. Default: none."
    )
    by_capacity: dict[Capacity, Money] = Field(
        default_factory=dict,
        description="Per replica and hour by how the replica's machine is bought (the "
        "endpoint's capacity: on-demand, spot, reserved), for example {spot: '1.40', "
        "on-demand: '4.20'}; replicas of a kind not listed here, or of no kind, cost "
        "replicaHour. A pool with preferCapacity tries its kinds cheapest first. Needs "
        "replicaHour. Default: none.",
    )

    def replica_price(self, capacity: Capacity | None) -> Decimal | None:
        """What one replica of `capacity` costs per hour (None: not priced per replica)."""
        if capacity is not None and capacity in self.by_capacity:
            return self.by_capacity[capacity]
        return self.replica_hour

    @model_validator(mode="after")
    def _one_kind(self) -> Price:
        per_token = self.input is not None or self.output is not None
        if self.cached_input is not None and self.input is None:
            raise ValueError("cachedInput needs input: set the uncached input price too")
        if per_token and (self.input is None or self.output is None):
            raise ValueError("a per-token price needs both input and output")
        if per_token and self.replica_hour is not None:
            raise ValueError(
                "price a pool per token (input, output) or per replica-hour (replicaHour), not both"
            )
        if self.by_capacity and self.replica_hour is None:
            raise ValueError(
                "byCapacity needs replicaHour: the price of a replica of a kind it does not "
                "list (byCapacity prices owned replicas, not tokens)"
            )
        if not per_token and self.replica_hour is None:
            raise ValueError("a price needs input and output, or replicaHour")
        return self
