"""Cost-aware overflow: the route model, the decision (pressure, hysteresis, floor and cap,
the cheapest paid pool not resting), where it lands in the plan and in Envoy's resources,
and how a 429's Retry-After is read."""

from __future__ import annotations

import email.utils
from typing import Any

import pytest
from harness.builders import policy, pool
from pydantic import ValidationError

from compiler.compile import PolicyState, compile_plan
from policies.models import Overflow, Pool, Route, RoutingPolicy
from signals.overflow import OverflowDecision, overflow_signals, provider_order
from signals.telemetry import TelemetryRecord
from xdsserver.signals import DEFAULT_REST, MAX_REST, ProviderRests, retry_after_seconds
from xdsserver.translate import translate

NOW = 1000.0
PORTS = (8001, 8002, 8003, 8004)


def record(running: float, waiting: float = 0.0, *, at: float = NOW - 1) -> TelemetryRecord:
    return TelemetryRecord(at=at, running=running, waiting=waiting, max_running=8)


def paid(name: str, port: int = 9443) -> dict[str, Any]:
    return pool(
        name,
        [],
        endpoints=[{"address": "localhost", "port": port}],
        healthCheck={"enabled": False},
    )


def overflow_route(**overflow: Any) -> dict[str, Any]:
    return {
        "name": "chat",
        "tiers": [["owned"]],
        "sessionAffinity": {"header": "x-session-id"},
        "overflow": {"pools": ["cheap", "dear"], "signal": "fill", **overflow},
    }


def state(
    fill: float | None,
    *,
    previous: OverflowDecision | None = None,
    resting: dict[str, float] | None = None,
    now: float = NOW,
    **overflow: Any,
) -> PolicyState:
    objects = [
        Pool.model_validate(pool("owned", PORTS, telemetry={"format": "vllm"})),
        Pool.model_validate(paid("cheap", 9443)),
        Pool.model_validate(paid("dear", 9444)),
        RoutingPolicy.model_validate(policy("main", 10000, [overflow_route(**overflow)])),
    ]
    telemetry = (
        {}
        if fill is None
        else {"owned": {f"127.0.0.1:{port}": record(8 * fill, at=now - 1) for port in PORTS}}
    )
    return PolicyState.from_objects(
        objects,
        telemetry=telemetry,
        now=now,
        previous_overflow={"main/chat": previous} if previous is not None else {},
        provider_backoff=resting or {},
    )


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pools": []}, "at least 1"),
        ({"pools": ["a", "a"]}, "listed twice"),
        ({"pools": ["a"], "minShare": 30, "maxShare": 20}, "minShare must not be above"),
        ({"pools": ["a"], "low": 1.0, "high": 1.0}, "hysteresis band"),
        ({"pools": ["a"], "maxShare": 101}, "less than or equal to 100"),
    ],
)
def test_bad_overflow_is_refused_with_the_field_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Overflow.model_validate(fields)


def test_a_pool_cannot_be_both_a_failover_tier_and_an_overflow_pool() -> None:
    with pytest.raises(ValidationError, match=r"both in a tier and in overflow\.pools"):
        Route.model_validate(
            {
                "name": "r",
                "tiers": [["owned"], ["cheap"]],
                "overflow": {"pools": ["cheap"], "signal": "fill"},
            }
        )


# --------------------------------------------------------------------------- the decision


def decision(fill: float | None, **kwargs: Any) -> OverflowDecision:
    plan = compile_plan(state(fill, **kwargs))
    return plan.overflow["main/chat"]


def test_an_owned_pool_with_room_sends_nothing_to_paid_pools() -> None:
    calm = decision(0.5)
    assert (calm.plain, calm.sessions) == (0.0, 0.0)
    assert calm.provider == "cheap"


def test_a_saturated_pool_sends_its_excess_to_the_cheapest_paid_pool_plain_requests_first() -> None:
    # Fill 1.35 over a bound of 0.9: pressure 1.5, half again too much: half the requests
    # without a session go to the paid pool at once, conversations stay.
    hot = decision(1.35)
    assert hot.pressure == pytest.approx(1.5)
    assert (hot.plain, hot.sessions) == (0.5, 0.0)
    assert hot.provider == "cheap"
    # Still saturated a rise interval (3 s) later: more, up to all plain requests; then
    # conversations.
    assert decision(1.35, previous=hot, now=NOW + 2).plain == hot.plain  # not yet
    later = decision(1.35, previous=hot, now=NOW + 3.1)
    assert (later.plain, later.sessions) == (1.0, 0.0)
    last = decision(1.35, previous=later, now=NOW + 6.2)
    assert later.plain == 1.0 and last.sessions > 0.0


def test_feed_forward_adds_the_excess_demand_of_what_stays_each_round_and_holds_nothing() -> None:
    # Fill 1.35 over a bound of 0.9: a third of the demand is above it. The loop sends half
    # the plain requests; the feed-forward, at weight 0.6, a third of the other half on top.
    hot = decision(1.35, feedForward=0.6)
    assert hot.plain == pytest.approx(0.5 + 0.5 * 0.6 / 3)
    assert hot.sessions == 0.0 and hot.level == decision(1.35).level
    # Next round, before the rise interval: the loop holds, the feed-forward follows the fill.
    less = decision(1.0, feedForward=0.6, previous=hot, now=NOW + 1)
    assert less.plain == pytest.approx(0.5 + 0.5 * 0.6 * (1 - 0.9 / 1.0))
    # At or under the bound it adds nothing; without telemetry nothing at all.
    assert decision(0.85, feedForward=1.0, previous=hot, now=NOW + 2).plain == 0.5
    assert decision(None, feedForward=1.0).plain == 0.0
    # Off by default, and with conversations 'with' both kinds move together.
    both = decision(1.35, feedForward=1.0, conversations="with")
    assert (
        both.plain == both.sessions > 1.0 - decision(1.35, conversations="with").level.share("all")
    )


def test_the_share_comes_back_by_the_headroom_under_low_and_holds_in_the_band() -> None:
    hot = decision(1.35)
    # In the band (pressure between low 0.8 and high 1.0): nothing moves.
    band = decision(0.8, previous=hot, now=NOW + 10)
    assert band.plain == hot.plain
    # At or below low, no sooner than the recover interval (5 s): just under low, one step
    # (10%) back; with more headroom, as many steps as it holds (fill 0.5: pressure 0.56,
    # 0.24 under low: two steps).
    early = decision(0.5, previous=hot, now=NOW + 4)
    assert early.plain == hot.plain
    one = decision(0.7, previous=hot, now=NOW + 5.1)
    assert one.plain == pytest.approx(hot.plain - 0.1)
    back = decision(0.5, previous=hot, now=NOW + 5.1)
    assert back.plain == pytest.approx(hot.plain - 0.2)
    again = decision(0.5, previous=back, now=NOW + 6)
    assert again.plain == back.plain  # the next step waits for its own interval
    assert back.next_step_at == pytest.approx(NOW + 5.1 + 5)
    idle = decision(0.0, previous=hot, now=NOW + 5.1)
    assert idle.plain == 0.0  # 0.8 under low: eight steps, more than there are


def test_without_telemetry_nothing_goes_to_paid_pools() -> None:
    hot = decision(1.35)
    gone = decision(None, previous=hot, now=NOW + 1)
    assert (gone.plain, gone.sessions) == (0.0, 0.0)


def test_floor_and_cap_hold_whatever_the_telemetry_says() -> None:
    static = {"minShare": 20, "maxShare": 20, "conversations": "with"}
    assert (decision(0.1, **static).plain, decision(0.1, **static).sessions) == (0.2, 0.2)
    assert decision(3.0, **static).plain == 0.2
    capped = decision(3.0, maxShare=30)
    assert capped.plain == 0.3


def test_a_resting_pool_is_skipped_until_its_retry_after_and_none_left_sends_nothing() -> None:
    resting = decision(1.35, resting={"cheap": NOW + 30})
    assert resting.provider == "dear" and resting.plain == 0.5
    assert resting.next_step_at <= NOW + 30
    back = decision(1.35, resting={"cheap": NOW - 1})
    assert back.provider == "cheap"
    none = decision(1.35, resting={"cheap": NOW + 30, "dear": NOW + 30})
    assert (none.provider, none.plain, none.sessions) == ("", 0.0, 0.0)


def test_the_fill_signal_reads_running_and_waiting_over_the_batch() -> None:
    overflow = Overflow.model_validate({"pools": ["a"], "fill": 0.5})
    endpoints = Pool.model_validate(pool("owned", PORTS[:2])).spec.endpoints
    telemetry = {"127.0.0.1:8001": record(8, 4), "127.0.0.1:8002": record(4)}
    signals = {
        s.name: s for s in overflow_signals(overflow, endpoints, telemetry, now=NOW, max_age=10)
    }
    assert signals["fill"].mean == pytest.approx((1.5 + 0.5) / 2)
    assert signals["fill"].pressure == pytest.approx(2.0)


def priced(name: str, price: dict[str, Any] | None) -> Pool:
    """A paid pool (a provider's DNS name over TLS) with a per-token ``Pool.spec.price``."""
    spec: dict[str, Any] = {
        "endpoints": [{"address": f"{name}.provider.example", "port": 443}],
        "tls": {"sni": f"{name}.provider.example"},
    }
    if price is not None:
        spec["price"] = price
    return Pool.model_validate({"metadata": {"name": name}, "spec": spec})


@pytest.mark.parametrize(
    ("prices", "order"),
    [
        pytest.param(
            {"a": {"input": 3, "output": 15}, "b": {"input": 0.2, "output": 0.6}, "c": None},
            ["b", "a", "c"],
            id="cheapest first, unpriced last",
        ),
        pytest.param({"a": None, "b": None, "c": None}, ["a", "b", "c"], id="listed order"),
        pytest.param(
            {"a": {"input": "2.50", "output": "10"}, "b": {"replicaHour": "4.90"}},
            ["a", "b", "c"],
            id="a price per replica-hour is no price per token",
        ),
        pytest.param(
            {"a": {"input": "0.15", "cachedInput": "0.075", "output": "0.60"}, "b": None},
            ["a", "b", "c"],
            id="decimal strings, cached input ignored",
        ),
        pytest.param(
            {"a": {"input": "0.5", "output": "2"}, "b": {"input": "1", "output": "1"}},
            ["b", "a", "c"],
            id="input plus output decides",
        ),
        pytest.param(
            {"a": {"input": 3, "output": 15, "currency": "EUR"}, "b": {"input": 1, "output": 1}},
            ["a", "b", "c"],
            id="two currencies are not compared",
        ),
    ],
)
def test_paid_pools_are_taken_cheapest_first(
    prices: dict[str, dict[str, Any] | None], order: list[str]
) -> None:
    overflow = Overflow.model_validate({"pools": ["a", "b", "c"]})
    pools = {name: priced(name, price) for name, price in prices.items()}
    pools.setdefault("c", priced("c", None))
    assert provider_order(overflow, pools) == order


# --------------------------------------------------------------------------- Envoy


def resources(fill: float | None, **kwargs: Any) -> Any:
    plan = compile_plan(state(fill, **kwargs))
    fleet = plan.fleet("default")
    assert fleet is not None
    return translate(fleet), fleet


def test_overflow_is_route_entries_with_a_runtime_fraction_to_the_paid_pools_aggregate() -> None:
    out, fleet = resources(1.35 * 2)  # pressure 3: all plain requests at once
    clusters = {c.name: c for c in out.clusters}
    assert "main/chat/provider/cheap" in clusters and "main/chat/provider/dear" in clusters
    aggregate = clusters["main/chat/overflow/cheap"]
    assert aggregate.cluster_type.name == "envoy.clusters.aggregate"
    entries = {r.name: r for r in out.routes[0].virtual_hosts[0].routes}
    plain = entries["main/chat#0/overflow"]
    assert plain.route.cluster == "main/chat/overflow/cheap"
    assert plain.match.runtime_fraction.default_value.numerator == 1_000_000
    assert plain.route.retry_policy.retry_priority.name.endswith("previous_priorities")
    assert plain.route.auto_host_rewrite.value
    # Conversations stay: no session overflow entry yet, and it would come first.
    assert "main/chat#0/affinity/overflow" not in entries
    names = list(entries)
    assert names.index("main/chat#0/affinity") < names.index("main/chat#0/overflow")
    assert names.index("main/chat#0/overflow") < names.index("main/chat#0")
    # The access log reports each attempt's pool and Retry-After.
    assert fleet.listeners[0].upstream_signals and fleet.listeners[0].overflows


def test_calm_means_no_overflow_entry_but_the_same_clusters() -> None:
    hot, _ = resources(2.7)
    calm, _ = resources(0.3)
    assert [c.name for c in calm.clusters] == [c.name for c in hot.clusters]
    assert not any(r.name.endswith("/overflow") for r in calm.routes[0].virtual_hosts[0].routes)


def test_a_resting_pool_moves_the_overflow_to_the_next_aggregate_in_rds_alone() -> None:
    before, _ = resources(2.7)
    after, _ = resources(2.7, resting={"cheap": NOW + 30})
    assert [c.SerializeToString() for c in before.clusters] == [
        c.SerializeToString() for c in after.clusters
    ]
    entries = {r.name: r for r in after.routes[0].virtual_hosts[0].routes}
    assert entries["main/chat#0/overflow"].route.cluster == "main/chat/overflow/dear"


# --------------------------------------------------------------------------- Retry-After


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        (" 2 ", 2.0),
        ("0", 0.0),
        ("-3", 0.0),
        ("soon", DEFAULT_REST),
        ("99999999", MAX_REST),
        (email.utils.formatdate(NOW + 12, usegmt=True), 12.0),
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(value: str, seconds: float) -> None:
    assert retry_after_seconds(value, NOW) == pytest.approx(seconds, abs=1)


def test_a_rest_only_grows_and_ends_on_time() -> None:
    clock = [NOW]
    rests = ProviderRests(clock=lambda: clock[0])
    calls: list[None] = []
    rests.listeners.append(lambda: calls.append(None))
    rests.observe("cheap", "10")
    rests.observe("cheap", "3")  # a shorter one does not cut the rest
    assert rests.active(NOW) == {"cheap": NOW + 10} and len(calls) == 1
    rests.observe("dear", None)
    assert rests.active(NOW)["dear"] == NOW + DEFAULT_REST
    assert "cheap" not in rests.active(NOW + 10)
