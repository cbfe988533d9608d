"""preferCapacity ordered by the pool's per-kind replica-hour prices (``price.byCapacity``):
cheapest first where the kinds are priced, the stated order otherwise, and what a priced
pool's replicas cost by kind."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from compiler import compile_plan
from policies import Pool, RoutingPolicy
from signals import PolicyState
from signals.capacity import pool_costs


def _pool(prefer: list[str], price: dict[str, Any] | None = None) -> Pool:
    spec: dict[str, Any] = {
        "models": ["llama"],
        "preferCapacity": prefer,
        "endpoints": [
            {"address": "10.0.1.1", "port": 8000, "capacity": "spot"},
            {"address": "10.0.1.2", "port": 8000, "capacity": "on-demand"},
            {"address": "10.0.1.3", "port": 8000, "capacity": "reserved"},
            {"address": "10.0.1.4", "port": 8000},
        ],
    }
    if price is not None:
        spec["price"] = price
    return Pool.model_validate({"kind": "Pool", "metadata": {"name": "llama"}, "spec": spec})


@pytest.mark.parametrize(
    ("prefer", "by_capacity", "order"),
    [
        # No per-kind prices: the stated order.
        (["on-demand", "spot"], None, ["on-demand", "spot"]),
        # Priced: cheapest first, whatever was stated.
        (["on-demand", "spot"], {"spot": "1.40", "on-demand": "4.20"}, ["spot", "on-demand"]),
        # A tie keeps the stated order; an unpriced kind goes after the priced ones.
        (
            ["reserved", "on-demand", "spot"],
            {"spot": "2", "on-demand": "2"},
            ["on-demand", "spot", "reserved"],
        ),
        # Only the listed kinds are ordered: prices of others do not add them.
        (["spot"], {"reserved": "0.5", "spot": "1"}, ["spot"]),
    ],
)
def test_prefer_capacity_is_ordered_by_price_where_the_kinds_have_one(
    prefer: list[str], by_capacity: dict[str, str] | None, order: list[str]
) -> None:
    price = {"replicaHour": "4.20", "byCapacity": by_capacity} if by_capacity else None
    assert _pool(prefer, price).spec.capacity_order() == order


def test_the_cheapest_kind_gets_priority_zero() -> None:
    pool = _pool(
        ["on-demand", "spot"],
        {"replicaHour": "4.20", "byCapacity": {"spot": "1.40", "on-demand": "4.20"}},
    )
    policy = RoutingPolicy.model_validate(
        {
            "kind": "RoutingPolicy",
            "metadata": {"name": "chat"},
            "spec": {"routes": [{"name": "chat", "tiers": [["llama"]]}]},
        }
    )
    plan = compile_plan(PolicyState.from_objects([pool, policy]))
    [cluster] = plan.fleets[0].clusters
    priority = {e.address: e.priority for e in cluster.endpoints}
    # spot (cheapest) first, then on-demand, then the unlisted kind and the unknown one.
    assert priority == {"10.0.1.1": 0, "10.0.1.2": 1, "10.0.1.3": 2, "10.0.1.4": 2}


@pytest.mark.parametrize(
    ("price", "words"),
    [
        ({"byCapacity": {"spot": "1"}}, "byCapacity needs replicaHour"),
        ({"replicaHour": "4", "byCapacity": {"preemptible": "1"}}, "byCapacity.preemptible"),
        ({"replicaHour": "4", "byCapacity": {"spot": "-1"}}, "cannot be negative"),
        (
            {"input": "1", "output": "2", "byCapacity": {"spot": "1"}},
            "byCapacity needs replicaHour",
        ),
    ],
)
def test_bad_per_kind_prices_are_refused_naming_the_field(
    price: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        _pool(["spot"], price)
    assert words in str(caught.value)
    assert "price" in str(caught.value)


def test_a_replica_costs_the_price_of_its_kind() -> None:
    pool = _pool(
        ["spot", "on-demand"],
        {"replicaHour": "4.00", "byCapacity": {"spot": "1.00", "reserved": "2.50"}},
    )
    # spot 1.00 + on-demand 4.00 (replicaHour) + reserved 2.50 + unknown 4.00 (replicaHour)
    [cost] = pool_costs(PolicyState.from_objects([pool]), {}, elapsed=3600.0)
    assert cost.hourly == Decimal("11.50") and cost.cost == Decimal("11.50")
