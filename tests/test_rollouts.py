"""Rollouts without Envoy: validation through the REST API (422 naming the field, etcd
untouched), the verdict arithmetic, and what a watched route's listener asks Envoy to log."""

from __future__ import annotations

import copy
import urllib.parse
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler
from typing import Any, cast

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from harness.api import Harness, running_api
from harness.builders import policy, pool, rollout
from harness.jsonserver import json_server

from commands.cli import render_rollout
from compiler import compile_plan
from compiler.rollout import BUCKET_BOUNDS, PoolSignals, evaluate, quantile
from compiler.rolloutweights import policy_with, tier_weights
from controlplane.etcd import KeyValue
from controlplane.etcd.keys import encode_json
from controlplane.local import EmbeddedEtcd
from controlplane.rollouts.analysis import PrometheusQueries
from controlplane.rollouts.signals import SignalPublisher, collect, signals_key
from policies import PolicyError, Rollout, RoutingPolicy, parse_object
from policies.models import AnalysisRule
from signals import PolicyState
from xdsserver.signals import SignalBook
from xdsserver.translate.listeners import SIGNALS_CLUSTER, translate_listener


@pytest.fixture
async def api(etcd: EmbeddedEtcd, etcd_prefix: str) -> AsyncIterator[Harness]:
    async with running_api(etcd.endpoint, etcd_prefix) as harness:
        for body in (
            pool("chat"),
            pool("next", [8003]),
            pool("spare", [8004]),
            policy("main", pools=("chat",)),
        ):
            path = "pools" if body["kind"] == "Pool" else "routingpolicies"
            response = await harness.http.post(f"/v1/{path}", json=body)
            assert response.status_code == 201, response.text
        yield harness


def _set(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out["spec"]
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return out


INVALID = [
    pytest.param("target.route", "nope", "spec.target.route", id="unknown route"),
    pytest.param("target.policy", "nope", "spec.target.policy", id="unknown policy"),
    pytest.param("target.tier", 3, "spec.target.tier", id="unknown tier"),
    pytest.param("canary", "ghost", "spec.canary", id="unknown canary pool"),
    pytest.param("stable", "spare", "spec.stable", id="stable pool not in the tier"),
    pytest.param(
        "steps",
        [{"weights": {"chat": 60, "next": 30}}],
        "spec.steps[0].weights",
        id="weights that do not add up",
    ),
    pytest.param(
        "steps",
        [{"weight": 50}, {"weight": 20}],
        "spec.steps[1].weight",
        id="steps out of order",
    ),
    pytest.param(
        "analysis",
        {"rules": [{"metric": "tokensPerJoule", "max": 1}]},
        "spec.analysis.rules[0].metric",
        id="a rule on a metric that does not exist",
    ),
    pytest.param(
        "analysis",
        {"rules": [{"query": "sum(rate(x[1m]))", "max": 1}]},
        "spec.analysis.rules[0].query",
        id="a query rule without prometheus",
    ),
    pytest.param("steps", [{"weight": 10, "weights": {"chat": 100}}], "spec.steps[0]", id="both"),
    pytest.param("fleets", ["edge"], "spec.fleets[0]", id="an unknown canary fleet"),
    pytest.param("fleets", ["default", "default"], "spec.fleets", id="a fleet named twice"),
]


@pytest.mark.parametrize(("path", "value", "loc"), INVALID)
async def test_invalid_rollouts_get_422_naming_the_field_and_change_nothing(
    api: Harness, path: str, value: Any, loc: str
) -> None:
    body = _set(rollout(), path, value)
    for method, url in (("POST", "/v1/rollouts"), ("PUT", "/v1/rollouts/canary")):
        response = await api.http.request(method, url, json=body)
        assert response.status_code == 422, response.text
        assert loc in [d["loc"] for d in response.json()["detail"]], response.json()
    assert await api.raw("objects/rollouts/canary") is None
    assert await api.raw("status/rollouts/canary") is None


async def test_a_valid_rollout_is_stored_and_commands_wait_for_a_driver(api: Harness) -> None:
    created = await api.http.post("/v1/rollouts", json=rollout())
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["steps"][0]["minDuration"] == "30s"
    status = (await api.http.get("/v1/rollouts/canary/status")).json()
    assert status["phase"] == "Pending"
    assert status["steps"] == [{"chat": 90, "next": 10}, {"chat": 0, "next": 100}]
    assert (await api.http.post("/v1/rollouts/canary/pause")).status_code == 409
    assert (await api.http.post("/v1/rollouts/canary/explode")).status_code == 404
    assert (await api.http.post("/v1/rollouts/missing/pause")).status_code == 404
    # A second rollout of the same tier is refused.
    other = rollout()
    other["metadata"]["name"] = "other"
    response = await api.http.post("/v1/rollouts", json=other)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "spec.target"


def signals(requests: int, errors: int = 0, ttfb: float = 0.05) -> PoolSignals:
    out = PoolSignals()
    for i in range(requests):
        out.observe(500 if i < errors else 200, ttfb, ttfb * 2)
    return out


RULES = [
    AnalysisRule(metric="errorRate", max=0.05),
    AnalysisRule(metric="ttfb", percentile=95, max_ratio=1.5),
]


@pytest.mark.parametrize(
    ("canary", "stable", "stable_weight", "outcomes"),
    [
        pytest.param(signals(5), signals(100), 95, ["waiting", "waiting"], id="no sample yet"),
        pytest.param(signals(50), signals(100), 95, ["pass", "pass"], id="healthy"),
        pytest.param(signals(50, 10), signals(100), 95, ["fail", "pass"], id="errors"),
        pytest.param(signals(50, ttfb=0.15), signals(100), 95, ["pass", "fail"], id="3x slower"),
        pytest.param(signals(50), signals(5), 95, ["pass", "waiting"], id="stable too small"),
        pytest.param(signals(50), PoolSignals(), 0, ["pass", "skipped"], id="no stable left"),
    ],
)
def test_verdicts(
    canary: PoolSignals, stable: PoolSignals, stable_weight: int, outcomes: list[str]
) -> None:
    verdict = evaluate(
        RULES, min_sample=20, canary=canary, stable=stable, stable_weight=stable_weight
    )
    assert [r.outcome for r in verdict.results] == outcomes


def test_signals_subtract_and_add_and_survive_json() -> None:
    early = signals(10, 1)
    later = signals(30, 4)
    step = later.since(early)
    assert (step.requests, step.errors) == (20, 3)
    assert PoolSignals.from_json(step.as_json()) == step
    both = PoolSignals()
    both.add(step)
    both.add(step)
    assert both.requests == 40


def test_percentiles_are_within_a_bucket() -> None:
    buckets: dict[int, int] = {}
    for ms in range(1, 1001):
        s = PoolSignals()
        s.observe(200, ms / 1000, None)
        for k, v in s.ttfb.items():
            buckets[k] = buckets.get(k, 0) + v
    for q in (0.5, 0.9, 0.99):
        value = quantile(buckets, q)
        assert value is not None and abs(value - q) / q < 0.2
    assert BUCKET_BOUNDS[0] < 0.001 < 600 < BUCKET_BOUNDS[-1]


def test_only_listeners_of_watched_routes_send_upstream_logs() -> None:
    objects = [
        parse_object(pool("chat")),
        parse_object(pool("next", [8003])),
        parse_object(policy("main", 10000, pools=("chat",))),
        parse_object(policy("other", 10001, pools=("chat",))),
        parse_object(rollout()),
    ]
    plan = compile_plan(PolicyState.from_objects(objects))
    listeners = {listener.port: listener for listener in plan.fleets[0].listeners}
    assert listeners[10000].upstream_signals and not listeners[10001].upstream_signals
    # Every listener logs token usage to the same cluster (its listener's access log); the
    # upstream signals are the router's upstream log.
    watched = _router(translate_listener(listeners[10000]))
    unwatched = _router(translate_listener(listeners[10001]))
    assert SIGNALS_CLUSTER.encode() in watched.SerializeToString()
    assert SIGNALS_CLUSTER.encode() not in unwatched.SerializeToString()
    assert not unwatched.upstream_log


def _router(listener: Any) -> router_pb2.Router:
    """The router filter's config of a translated listener."""
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    (router_filter,) = (f for f in manager.http_filters if f.name == "envoy.filters.http.router")
    router = router_pb2.Router()
    router_filter.typed_config.Unpack(router)
    return router


def test_status_draws_a_bar_for_the_current_step() -> None:
    text = render_rollout(
        {
            "name": "canary",
            "phase": "Progressing",
            "steps": [{"chat": 95, "next": 5}, {"chat": 50, "next": 50}],
            "step": 0,
            "stepStartedAt": 100.0,
            "minDuration": 10,
            "verdict": {
                "outcome": "waiting",
                "canary": {"requests": 3, "errors": 0},
                "stable": {"requests": 60, "errors": 0},
                "rules": [{"rule": "errorRate", "outcome": "waiting", "message": "3 of 50"}],
            },
        },
        now=105.0,
    )
    assert ">> step 0: chat=95% next=5% [" + "#" * 15 + "-" * 15 + "]" in text
    assert "canary 3 requests" in text and "errorRate: waiting" in text
    assert "only)" not in text
    in_blue = render_rollout(
        {"phase": "Progressing", "steps": [{"chat": 95, "next": 5}], "step": 0, "fleets": ["blue"]},
        now=105.0,
    )
    assert "(fleets blue only)" in in_blue.splitlines()[1]


async def test_query_rules_read_prometheus_with_the_pools_filled_in() -> None:
    # No Prometheus server here: a stand-in that answers its HTTP query API.
    seen: list[str] = []

    def prometheus_api(request: BaseHTTPRequestHandler) -> tuple[Any, dict[str, str]]:
        query = urllib.parse.parse_qs(urllib.parse.urlparse(request.path).query)["query"][0]
        seen.append(query)
        value = "0.25" if "next" in query else "not a number"
        result = [{"metric": {}, "value": [0, value]}]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}, {}

    queries = PrometheusQueries()
    with json_server(prometheus_api) as port:
        try:
            body = rollout(
                analysis={
                    "prometheus": {"url": f"http://127.0.0.1:{port}"},
                    "rules": [
                        {"query": 'sum(rate(errors{pool="{canary}"}[{interval}]))', "max": 0.1},
                        {"query": 'sum(rate(errors{pool="{stable}"}[{interval}]))', "max": 0.1},
                    ],
                }
            )
            parsed = parse_object(body)
            assert isinstance(parsed, Rollout)
            state = {"startWeights": {"chat": 100, "next": 0}, "stepStartedAt": 100.0}
            values = await queries.values(parsed, state, now=130.0)
        finally:
            await queries.aclose()
    assert seen == ['sum(rate(errors{pool="next"}[30s]))', 'sum(rate(errors{pool="chat"}[30s]))']
    assert values == {0: 0.25, 1: None}
    verdict = evaluate(
        parsed.spec.analysis.rules,
        min_sample=1,
        canary=PoolSignals(),
        stable=PoolSignals(),
        stable_weight=90,
        queried=values,
    )
    assert [r.outcome for r in verdict.results] == ["fail", "waiting"]


def test_a_tier_weighs_its_pools_differently_in_the_fleets_that_name_it() -> None:
    objects = [
        parse_object(pool("chat")),
        parse_object(pool("next", [8003])),
        parse_object(
            {
                **policy("main", ("chat",)),
                "spec": {
                    "fleets": ["blue", "green"],
                    "listener": {"port": 10000},
                    "routes": [
                        {
                            "name": "all",
                            "tiers": [
                                {
                                    "pools": [
                                        {"pool": "chat", "weight": 100},
                                        {"pool": "next", "weight": 0},
                                    ],
                                    "fleetWeights": {"blue": {"chat": 75, "next": 25}},
                                }
                            ],
                        }
                    ],
                },
            }
        ),
    ]
    plan = compile_plan(PolicyState.from_objects(objects))
    shares = {}
    for fleet in plan.fleets:
        if fleet.fleet == "default":
            continue
        [cluster] = [c for c in fleet.clusters if c.name == "main/all"]
        total = sum(e.weight for e in cluster.endpoints)
        shares[fleet.fleet] = {
            p: round(100 * sum(e.weight for e in cluster.endpoints if e.pool == p) / total)
            for p in ("chat", "next")
        }
    assert shares == {"blue": {"chat": 75, "next": 25}, "green": {"chat": 100, "next": 0}}


def test_fleet_weights_may_only_name_pools_of_the_tier() -> None:
    body = policy("main", ("chat",))
    body["spec"]["routes"][0]["tiers"] = [{"pools": ["chat"], "fleetWeights": {"b": {"x": 1}}}]
    with pytest.raises(PolicyError, match="'x', which is not in the tier"):
        parse_object(body)


def test_signals_are_kept_per_fleet_and_collected_for_the_fleets_asked() -> None:
    book = SignalBook(lambda cluster, address, port: "next" if port == 8003 else "chat")

    def entry(port: int, status: int) -> accesslog_pb2.HTTPAccessLogEntry:
        log = accesslog_pb2.HTTPAccessLogEntry()
        log.common_properties.upstream_cluster = "main/all"
        log.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
        log.common_properties.upstream_remote_address.socket_address.port_value = port
        log.response.response_code.value = status
        return log

    for _ in range(3):
        book.observe(entry(8003, 500), "blue")
    book.observe(entry(8003, 200), "green")
    book.observe(entry(8000, 200), "green")
    publisher = SignalPublisher(cast(Any, None), book, "r1")  # record() reads no store
    body = encode_json(publisher.record("main/all"))
    key = signals_key("r1", "main/all")
    items = {key: KeyValue(key.encode(), body, 1, 1, 1, 0)}
    every = collect(items, "main/all")["r1"]
    assert (every["next"].requests, every["next"].errors, every["chat"].requests) == (4, 3, 1)
    blue = collect(items, "main/all", ["blue"])["r1"]
    assert (blue["next"].requests, blue["next"].errors, "chat" in blue) == (3, 3, False)
    green = collect(items, "main/all", ["green"])["r1"]
    assert (green["next"].requests, green["next"].errors, green["chat"].requests) == (1, 0, 1)


def test_a_step_for_the_canary_fleets_writes_their_weights_and_one_for_every_fleet_clears_them() -> (
    None
):
    body = policy("main")
    pools = [{"pool": "chat", "weight": 100}, {"pool": "next", "weight": 0}]
    body["spec"]["routes"][0]["tiers"] = [{"pools": pools}]
    plain = parse_object(body)
    canary = parse_object(rollout(fleets=["blue"]))
    assert isinstance(plain, RoutingPolicy) and isinstance(canary, Rollout)

    reached = policy_with(canary, plain, {"chat": 100, "next": 0}, {"chat": 50, "next": 50})
    [tier] = reached["spec"]["routes"][0]["tiers"]
    assert tier["fleetWeights"] == {"blue": {"chat": 50, "next": 50}}
    assert tier["pools"] == pools

    # Widened to every fleet: the canary fleets' own weights must go, or blue would keep them.
    widened = parse_object(reached)
    assert isinstance(widened, RoutingPolicy)
    everywhere = policy_with(canary, widened, {"chat": 50, "next": 50})
    [tier] = everywhere["spec"]["routes"][0]["tiers"]
    assert not tier.get("fleetWeights")
    assert tier["pools"] == [{"pool": "chat", "weight": 50}, {"pool": "next", "weight": 50}]
    assert tier_weights(canary, widened) == {"chat": 100, "next": 0}
