"""A Budget's spec: how much one tenant may spend, in tokens or money, per calendar window."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from policies.models.fields import Model, Name
from policies.models.price import Currency, Money

BudgetWindow = Literal["minute", "hour", "day", "month"]
OverBudgetAction = Literal["reject", "divert"]


class BudgetSpec(Model):
    """A tenant's budget over a calendar window in UTC (a minute, an hour, a day starting at
    00:00 UTC, a month starting on the 1st). Spend is counted from every response's usage, on
    every Envoy of the fleet; once the window's spend reaches the budget, the tenant's requests
    are answered 429 (or diverted) until the window ends."""

    tenant: Annotated[str, Field(min_length=1, max_length=128)] = Field(
        description="The tenant: a value of the route's tenant header (the policy's "
        "serviceClasses.tenantHeader, x-tenant-id by default)."
    )
    window: BudgetWindow = Field(description="minute, hour, day or month, in UTC.")
    tokens: int | None = Field(
        None,
        ge=1,
        le=10**15,
        description="Most prompt plus completion tokens per window. Default: none.",
    )
    amount: Money | None = Field(
        None, description="Most money per window, at the pools' per-token prices. Default: none."
    )
    currency: Currency = Field(
        "USD", description="The currency of amount; spend in other currencies does not count."
    )
    service_class: Name | None = Field(
        None,
        alias="class",
        description="Count and limit only this service class's requests. Default: all.",
    )
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="Count and limit only this model's requests. Default: all models."
    )
    action: OverBudgetAction = Field(
        "reject",
        description="What a request past the budget gets: reject (429 in OpenAI's format, "
        "with Retry-After at the window's end) or divert (to divertTo). Default: reject.",
    )
    divert_to: Name | None = Field(
        None,
        description="With action divert: the route, in the same policy, whose pools take the "
        "tenant's requests (a cheaper pool, say). The request keeps its model: the route's "
        "pools must serve it.",
    )

    @model_validator(mode="after")
    def _limits(self) -> BudgetSpec:
        if (self.tokens is None) == (self.amount is None):
            raise ValueError("set exactly one of tokens and amount")
        if self.action == "divert" and self.divert_to is None:
            raise ValueError("action divert needs divertTo: the route that takes the requests")
        if self.action == "reject" and self.divert_to is not None:
            raise ValueError("divertTo is used with action divert only")
        return self
