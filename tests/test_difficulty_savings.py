"""What a virtual model saved against its large model's price: exact Decimal arithmetic, no
saving stated across currencies or for pools without a per-token price, and spend records
written before the virtual model was part of the key still read."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from harness.builders import policy, pool, route
from prometheus_client import CollectorRegistry, generate_latest

from controlplane.spend import SavingsCollector, SpendCollector
from policies.validate import parse_object
from signals import PolicyState
from signals.savings import virtual_savings
from signals.spend import Ledger, Spend, SpendKey, parse_rows

SMALL = {"currency": "USD", "input": "0.15", "cachedInput": "0.075", "output": "0.60"}
LARGE = {"currency": "USD", "input": "2.50", "cachedInput": "1.25", "output": "10"}
KEY = "main/auto"


def state(small: dict[str, Any], large: dict[str, Any], *large_tier: str) -> PolicyState:
    document = policy(
        "main",
        10000,
        [
            route("small", name="small", match={"models": ["s"]}),
            route(*(large_tier or ("large",)), name="large", match={"models": ["l"]}),
        ],
    )
    document["spec"]["virtualModels"] = [{"name": "auto", "small": "s", "large": "l"}]
    return PolicyState.from_objects(
        [
            parse_object(pool("small", [1], models=["s"], **small)),
            parse_object(pool("large", [2], models=["l"], **large)),
            parse_object(pool("spare", [3], models=["l"], price={**LARGE, "output": "12"})),
            parse_object(document),
        ]
    )


def row(pool: str, currency: str, cost: str, virtual: str = KEY) -> tuple[SpendKey, Spend]:
    """Requests of 1,000 prompt tokens (200 cached) and 300 completion tokens."""
    key = SpendKey("", "s" if pool == "small" else "l", pool, "", "main/x", currency, virtual)
    return key, Spend(2, 2000, 400, 600, Decimal(cost))


SMALL_ROW = row("small", "USD", "0.000618")  # (1600 x 0.15 + 400 x 0.075 + 600 x 0.60) / 1e6
LARGE_ROW = row("large", "USD", "0.0105")  # (1600 x 2.5 + 400 x 1.25 + 600 x 10) / 1e6


def test_the_saving_is_the_small_models_tokens_at_the_price_difference() -> None:
    rows = dict([SMALL_ROW, LARGE_ROW, row("small", "USD", "9", virtual="")])
    (saving,) = virtual_savings(state({"price": SMALL}, {"price": LARGE}), rows).values()
    assert saving.usage.requests == 4
    assert saving.usage.cost == Decimal("0.011118")
    assert saving.large_cost == Decimal("0.021")
    assert saving.saved == Decimal("0.009882")
    assert (saving.currency, saving.reason) == ("USD", "")
    assert saving.as_json()["saved"] == "0.009882"


@pytest.mark.parametrize(
    ("small", "large", "tier", "rows", "reason"),
    [
        pytest.param(
            {"price": {"replicaHour": "4.20"}},
            {"price": LARGE},
            (),
            [row("small", "", "0"), LARGE_ROW],
            "pool 'small' served it without a per-token price",
            id="owned-small",
        ),
        pytest.param(
            {"price": SMALL},
            {"price": {"replicaHour": "9"}},
            (),
            [SMALL_ROW],
            "pool 'large' of the large model 'l' has no per-token price",
            id="owned-large",
        ),
        pytest.param(
            {"price": {**SMALL, "currency": "EUR"}},
            {"price": LARGE},
            (),
            [row("small", "EUR", "0.0006"), LARGE_ROW],
            "served in EUR and USD; currencies are never converted",
            id="currencies",
        ),
        pytest.param(
            {"price": SMALL},
            {"price": LARGE},
            ("large", "spare"),
            [SMALL_ROW],
            "the pools of the large model 'l' have different prices",
            id="large-pools-disagree",
        ),
        pytest.param(
            {"price": SMALL},
            {"price": LARGE},
            (),
            [row("", "", "0")],
            "a host of no known pool served it without a per-token price",
            id="unknown-host",
        ),
    ],
)
def test_no_saving_is_stated_where_prices_do_not_compare(
    small: dict[str, Any],
    large: dict[str, Any],
    tier: tuple[str, ...],
    rows: list[tuple[SpendKey, Spend]],
    reason: str,
) -> None:
    (saving,) = virtual_savings(state(small, large, *tier), dict(rows)).values()
    assert saving.saved is None
    assert saving.large_cost is None
    assert saving.reason == reason
    assert saving.as_json()["reason"] == reason
    assert saving.usage.requests == 2 * len(rows)


def test_stored_rows_carry_the_virtual_model_last_so_older_readers_still_parse_them() -> None:
    ledger = Ledger()
    ledger.add(SMALL_ROW[0], SMALL_ROW[1], 0.0)
    ledger.add(row("small", "USD", "1", virtual="")[0], Spend(1, 10, 0, 5, Decimal(1)), 0.0)
    stored = ledger.record("")["totals"]
    assert sorted(len(r) for r in stored) == [11, 12]
    # What a reader of the eleven-field format takes from each row is unchanged.
    assert {tuple(r[:11]) for r in stored} == {
        ("", "s", "small", "", "main/x", "USD", 2, 2000, 400, 600, "0.000618"),
        ("", "s", "small", "", "main/x", "USD", 1, 10, 0, 5, "1"),
    }
    again = Ledger()
    again.load(ledger.record(""))
    assert again.totals == ledger.totals
    assert {key.virtual_model for key in again.totals} == {KEY, ""}
    assert list(parse_rows([["short"]])) == []


def test_metrics_sum_rows_that_differ_only_by_virtual_model_and_export_the_saving() -> None:
    ledger = Ledger()
    for key, spend in (SMALL_ROW, LARGE_ROW, row("small", "USD", "0.000618", virtual="")):
        ledger.add(key, spend, 0.0)
    registry = CollectorRegistry()
    registry.register(SpendCollector(ledger))
    registry.register(SavingsCollector(ledger, lambda: state({"price": SMALL}, {"price": LARGE})))
    text = generate_latest(registry).decode()
    small_requests = [
        line
        for line in text.splitlines()
        if line.startswith("kvpilot_usage_requests_total{") and 'pool="small"' in line
    ]
    assert len(small_requests) == 1 and small_requests[0].endswith(" 4.0"), small_requests
    assert (
        'kvpilot_virtual_model_spend_saved{currency="USD",virtual_model="main/auto"} 0.009882'
        in text
    )
