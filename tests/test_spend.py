"""Spend, prices and budgets as pure functions: exact money, calendar windows in UTC, a
replica's ledger stored and read back, the sum over replicas, budget verdicts and the route
entries they become, and the errors bad input gets."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from compiler.budgets import route_blocks
from compiler.plan import PlanClass, PlanRoute
from policies import PolicyError, parse_object
from policies.models import Budget, Pool
from signals.budgets import over_budgets
from signals.capacity import pool_costs
from signals.spend import (
    Ledger,
    Spend,
    SpendKey,
    TokenPrice,
    sum_records,
    window_bounds,
    window_id,
)
from signals.state import PolicyState
from signals.telemetry import TelemetryRecord
from xdsserver.usage import parse_route_name


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("window", "now", "start", "end"),
    [
        ("minute", "2026-12-03T14:45:59", "2026-12-03T14:45:00", "2026-12-03T14:46:00"),
        ("hour", "2026-12-03T23:59:59", "2026-12-03T23:00:00", "2026-12-04T00:00:00"),
        ("day", "2026-12-31T12:00:00", "2026-12-31T00:00:00", "2027-01-01T00:00:00"),
        ("month", "2026-12-31T23:00:00", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
        ("month", "2028-02-10T00:00:00", "2028-02-01T00:00:00", "2028-03-01T00:00:00"),
    ],
)
def test_windows_are_calendar_windows_in_utc(window: Any, now: str, start: str, end: str) -> None:
    begins, ends = window_bounds(window, at(now))
    assert (begins.timestamp(), ends.timestamp()) == (at(start), at(end))
    assert window_id(window, at(now)) == start + "Z"


def test_cost_is_exact_tokens_times_price() -> None:
    price = TokenPrice("USD", Decimal("2.50"), Decimal("1.25"), Decimal("10"))
    # 1,000 prompt tokens of which 400 cached, 333 completion tokens.
    assert price.cost(1000, 400, 333) == Decimal("0.00533")
    total = sum((price.cost(7, 3, 1) for _ in range(100_000)), Decimal(0))
    assert total == Decimal(100_000) * price.cost(7, 3, 1)  # no drift, unlike floats


KEY = SpendKey("acme", "m", "paid", "batch", "web/paid", "USD")


def test_a_ledger_reads_back_what_it_stored_and_replicas_sum() -> None:
    now = at("2026-12-03T14:45:10")
    ledger = Ledger()
    ledger.add(KEY, Spend(1, 10, 4, 5, Decimal("0.001")), now)
    ledger.add(KEY, Spend(1, 20, 0, 5, Decimal("0.002")), now + 1)
    assert ledger.take_changed() == {"acme"}
    record = ledger.record("acme")
    again = Ledger()
    again.load(record)
    assert again.totals == ledger.totals
    other = Ledger()
    other.add(KEY, Spend(2, 1, 1, 1, Decimal("0.5")), now)
    minute = sum_records([record, other.record("acme")], "minute", now)
    assert minute[KEY] == Spend(4, 31, 5, 11, Decimal("0.503"))
    # A record of an earlier minute counts in the totals, not in this minute.
    later = now + 60
    assert sum_records([record], "minute", later) == {}
    assert sum_records([record], None, later)[KEY].requests == 2


@pytest.mark.parametrize("order", [1, -1])
def test_a_ledger_read_back_keeps_the_newest_window_of_each_kind(order: int) -> None:
    """Each tenant's record holds the window it was last written in: a tenant that stopped
    before the minute turned keeps the older minute. Read back in any order, the newest
    window is the ledger's, as it was before the restart."""
    now = at("2026-12-03T14:45:59")
    ledger = Ledger()
    ledger.add(KEY, Spend(1, 10, 0, 5, Decimal("0.001")), now)
    early = ledger.record("acme")
    other = SpendKey("globex", "m", "paid", "batch", "web/paid", "USD")
    ledger.add(other, Spend(1, 20, 0, 5, Decimal("0.002")), now + 2)  # the next minute
    records = [early, ledger.record("globex")][::order]
    again = Ledger()
    for record in records:
        again.load(record)
    for window in ("minute", "hour"):
        assert dict(again.rows(window, now + 3)) == dict(ledger.rows(window, now + 3))
        assert sum_records(records, window, now + 3) == dict(ledger.rows(window, now + 3))
    assert again.totals == ledger.totals


def test_records_that_do_not_parse_are_skipped() -> None:
    bad = {"totals": [["a"], ["t", "m", "p", "c", "r", "USD", 1, "x", 0, 0, "0"], "junk"]}
    assert sum_records([bad, {"totals": "nope"}], None, 0.0) == {}


@pytest.mark.parametrize(
    ("name", "class_name"),
    [
        ("web/paid#0", ""),
        ("web/paid#3@batch", "batch"),
        ("web/paid#1@interactive/fallback", "interactive"),
        ("web/paid#0@batch/affinity", "batch"),
        ("web/paid#0/budget/acme", ""),
    ],
)
def test_route_entry_names_give_route_and_class(name: str, class_name: str) -> None:
    assert parse_route_name(name) == ("web/paid", class_name)


def budget(**spec: Any) -> Budget:
    obj = parse_object(
        {"kind": "Budget", "metadata": {"name": "b"}, "spec": {"tenant": "acme", **spec}}
    )
    assert isinstance(obj, Budget)
    return obj


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"window": "week", "tokens": 5}, "spec.window", "minute"),
        ({"window": "day"}, "spec", "exactly one of tokens and amount"),
        ({"window": "day", "tokens": 5, "amount": 1}, "spec", "exactly one"),
        ({"window": "day", "tokens": 0}, "spec.tokens", "greater than"),
        ({"window": "day", "amount": "-1"}, "spec.amount", "negative"),
        ({"window": "day", "amount": "1", "currency": "BTC"}, "spec.currency", "not supported"),
        ({"window": "day", "tokens": 5, "action": "divert"}, "spec", "divertTo"),
    ],
)
def test_bad_budgets_get_errors_naming_the_field(
    spec: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(PolicyError) as error:
        budget(**spec)
    assert field in str(error.value) and words in str(error.value)


@pytest.mark.parametrize(
    ("price", "field", "words"),
    [
        ({"input": -1, "output": 1}, "spec.price.input", "negative"),
        ({"input": "abc", "output": 1}, "spec.price.input", "not a number"),
        ({"input": "NaN", "output": 1}, "spec.price.input", "finite"),
        ({"input": 1, "output": 1, "currency": "usd"}, None, None),
        ({"input": 1, "output": 1, "currency": "ABC"}, "spec.price.currency", "ISO 4217"),
        ({"input": 1}, "spec.price", "both input and output"),
        ({"cachedInput": 1, "replicaHour": 2}, "spec.price", "cachedInput needs input"),
        ({"input": 1, "output": 1, "replicaHour": 2}, "spec.price", "not both"),
        ({"currency": "EUR"}, "spec.price", "replicaHour"),
    ],
)
def test_bad_prices_get_errors_naming_the_field(
    price: dict[str, Any], field: str | None, words: str | None
) -> None:
    body = {"kind": "Pool", "metadata": {"name": "p"}, "spec": {"price": price}}
    if field is None:
        pool = parse_object(body)
        assert isinstance(pool, Pool) and pool.spec.price is not None
        assert pool.spec.price.currency == "USD"
        return
    with pytest.raises(PolicyError) as error:
        parse_object(body)
    assert field in str(error.value) and words is not None and words in str(error.value)


def test_a_budget_is_spent_at_its_limit_and_blocks_until_the_window_ends() -> None:
    now = at("2026-12-03T14:45:10")
    tokens = budget(window="minute", tokens=100)
    money = budget(window="day", amount="0.01", currency="USD", model="m")
    rows = {KEY: Spend(3, 60, 0, 40, Decimal("0.01"))}
    other = {SpendKey("globex", "m", "paid", "", "web/paid", "USD"): Spend(9, 900, 0, 900)}
    over = over_budgets({"t": tokens, "d": money}, lambda window: rows | other, now)
    assert over == {"t": at("2026-12-03T14:46:00"), "d": at("2026-12-04T00:00:00")}
    rows[KEY].completion_tokens = 39
    rows[KEY].cost = Decimal("0.0099")
    assert over_budgets({"t": tokens, "d": money}, lambda window: rows | other, now) == {}


def test_blocks_land_on_the_routes_that_can_tell_their_class_and_model() -> None:
    classes = (
        PlanClass("batch", (("x-priority", "batch"),), (), "shed", 1.0, 10),
        PlanClass("interactive", (), (), "admit", 1.0, 10),
    )
    route = PlanRoute(
        name="web/paid",
        cluster="web/paid",
        models=("m",),
        path_prefix="/",
        headers=(),
        affinity=None,
        retries=None,
        timeouts=None,
        rate_limit=None,  # type: ignore[arg-type]
        host_rewrite=False,
        tiers=1,
        classes=classes,
        tenant_header="x-tenant-id",
    )
    budgets = {
        "all": budget(window="day", tokens=5),
        "batch": budget(window="day", tokens=5, **{"class": "batch"}),
        "fallback": budget(window="day", tokens=5, **{"class": "interactive"}),
        "other-model": budget(window="day", tokens=5, model="n"),
        "divert": budget(window="day", tokens=5, action="divert", divertTo="cheap"),
    }
    over = dict.fromkeys(budgets, 1_800_000_000.0)
    blocks = route_blocks(route, budgets, over, {"paid": "web/paid", "cheap": "web/cheap"})
    assert [(b.budget, b.service_class, b.divert_cluster) for b in blocks] == [
        ("all", "", ""),
        ("batch", "batch", ""),
        ("divert", "", "web/cheap"),
    ]
    assert "2027-01-15T08:00:00Z" in blocks[0].message


def test_owned_capacity_costs_its_replica_hours_and_reports_idle_cost() -> None:
    owned = parse_object(
        {
            "kind": "Pool",
            "metadata": {"name": "owned"},
            "spec": {
                "endpoints": [
                    {"address": "10.0.0.1", "port": 1},
                    {"address": "10.0.0.2", "port": 1},
                ],
                "price": {"replicaHour": "3.60"},
            },
        }
    )
    assert isinstance(owned, Pool)
    telemetry = {
        "owned": {
            "10.0.0.1:1": TelemetryRecord(at=0, running=8, max_running=32),
            "10.0.0.2:1": TelemetryRecord(at=0, running=24, max_running=32),
        }
    }
    state = PolicyState(pools={"owned": owned}, telemetry=telemetry)
    rows = {SpendKey("a", "m", "owned", "", "r"): Spend(1, 600, 0, 400)}
    [cost] = pool_costs(state, rows, elapsed=600.0)
    # Two replicas at 3.60 an hour for ten minutes: 1.20; half busy, so 0.60 bought idle time.
    assert (cost.replicas, cost.hourly, cost.cost) == (2, Decimal("7.20"), Decimal("1.2"))
    assert cost.utilization == 0.5 and cost.idle_cost == Decimal("0.6")
    assert cost.per_million == Decimal("1200")
