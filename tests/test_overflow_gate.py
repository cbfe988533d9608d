"""The gate (``overflow.maxInFlight``) as configuration: the field's bounds, the resources it
adds (the gate's internal listener and breaker, the aggregates that try it first) and the
route entries that use them; where it is left out; and the usage entry it leaves."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import (
    previous_priorities_config_pb2,
)
from harness.builders import policy, pool
from pydantic import ValidationError

from compiler.compile import PolicyState, compile_plan
from compiler.gate import GATE_OPEN
from policies.models import API_VERSION, Endpoint, Fleet, Overflow, Pool, RoutingPolicy
from signals.telemetry import TelemetryRecord
from xdsserver.translate import FleetResources, translate
from xdsserver.translate.gate import GATE_HEADER, GATE_RETRIES, SESSION_TRIES
from xdsserver.translate.metadata import GATE_UPSTREAM, PREFIX_KEY_HEADER
from xdsserver.translate.usage import USAGE_FILTER, USAGE_LUA
from xdsserver.usage import UsageBook

PORTS = (8001, 8002)


def _paid(name: str, port: int) -> dict[str, Any]:
    return pool(
        name, [], endpoints=[{"address": "localhost", "port": port}], healthCheck={"enabled": False}
    )


def _resources(route: dict[str, Any], *extra: dict[str, Any]) -> FleetResources:
    objects = [
        Pool.model_validate(pool("owned", PORTS)),
        Pool.model_validate(_paid("cheap", 9443)),
        *(Pool.model_validate(o) for o in extra),
        RoutingPolicy.model_validate(policy("main", 10000, [route])),
    ]
    plan = compile_plan(PolicyState.from_objects(objects, now=1000.0))
    fleet = plan.fleet("default")
    assert fleet is not None
    return translate(fleet)


def _route(**overflow: Any) -> dict[str, Any]:
    return {
        "name": "chat",
        "tiers": [["owned"]],
        "sessionAffinity": {"header": "x-session-id"},
        "overflow": {"pools": ["cheap"], "signal": "fill", "maxInFlight": 16, **overflow},
    }


def _entries(out: FleetResources) -> dict[str, Any]:
    return {r.name: r for r in out.routes[0].virtual_hosts[0].routes}


@pytest.mark.parametrize(
    ("value", "message"),
    [(0, "greater than or equal to 1"), (-3, "greater than or equal to 1"), ("many", "integer")],
)
def test_a_bad_limit_is_refused_with_the_field_named(value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as error:
        Overflow.model_validate({"pools": ["a"], "maxInFlight": value})
    assert "maxInFlight" in str(error.value)


def _auto_plan(
    envoys: dict[str, int],
    *,
    share: float | None = None,
    at: float = 999.0,
    fleets: tuple[str, ...] = ("default",),
    registered: dict[str, dict[str, Endpoint]] | None = None,
) -> Any:
    """Route ``main/chat`` with ``maxInFlight: auto`` over two replicas of 16 slots (their
    records written at `at`; the state's now is 1000), in `fleets`, beside a Fleet ``edge``
    of its own, and `envoys` connected per fleet."""
    gate = {"maxInFlight": "auto"} if share is None else {"maxInFlight": "auto", "gateShare": share}
    main = policy("main", 10000, [_route(**gate)])
    main["spec"]["fleets"] = list(fleets)
    objects = [
        Pool.model_validate(pool("owned", PORTS, telemetry={"maxAge": "10s"})),
        Pool.model_validate(_paid("cheap", 9443)),
        RoutingPolicy.model_validate(main),
        Fleet.model_validate(
            {"apiVersion": API_VERSION, "kind": "Fleet", "metadata": {"name": "edge"}, "spec": {}}
        ),
    ]
    records = {
        f"127.0.0.1:{port}": TelemetryRecord(at=at, running=3, waiting=0, max_running=16)
        for port in PORTS
    }
    state = PolicyState.from_objects(
        objects,
        now=1000.0,
        telemetry={"owned": records},
        envoys=envoys,
        registered=registered or {},
    )
    return compile_plan(state)


def _gate_limits(plan: Any) -> set[int | None]:
    return {
        c.circuit_breakers.max_requests
        for fleet in plan.fleets
        for c in fleet.clusters
        if c.kind == "gate"
    }


@pytest.mark.parametrize(
    ("envoys", "fleets", "counted", "limit"),
    [
        ({"default": 2}, ("default",), 2, 14),  # 90% of 32 slots over 2 Envoys
        ({}, ("default",), 0, 28),  # no Envoy yet: as for one
        ({"default": 1, "edge": 3}, ("default",), 1, 28),  # another fleet's do not count
        ({"default": 1, "edge": 3}, ("*",), 4, 7),  # every fleet's do
        ({"default": 1, "lost": 3}, ("default",), 4, 7),  # no config of its own: default's
        ({"default": 40}, ("default",), 40, 1),  # never under one
    ],
)
def test_an_auto_gate_splits_the_reported_slots_over_the_fleets_envoys(
    envoys: dict[str, int], fleets: tuple[str, ...], counted: int, limit: int
) -> None:
    plan = _auto_plan(envoys, fleets=fleets)
    assert _gate_limits(plan) == {limit}
    assert plan.gate_auto["main/chat"] == (32, counted)


@pytest.mark.parametrize(("share", "limit"), [(1.0, 32), (0.5, 16), (0.01, 1)])
def test_an_auto_gate_lets_in_the_share_of_the_slots_it_is_given(share: float, limit: int) -> None:
    plan = _auto_plan({"default": 1}, share=share)
    assert _gate_limits(plan) == {limit}
    assert plan.gate_auto["main/chat"] == (32, 1)


@pytest.mark.parametrize(
    ("overflow", "message"),
    [
        ({"maxInFlight": 32, "gateShare": 1.0}, "gateShare is for maxInFlight: auto"),
        ({"gateShare": 1.0}, "gateShare is for maxInFlight: auto"),
        ({"maxInFlight": "auto", "gateShare": 0}, "greater than 0"),
        ({"maxInFlight": "auto", "gateShare": 1.5}, "less than or equal to 1"),
    ],
)
def test_a_gate_share_outside_auto_or_out_of_bounds_is_refused(
    overflow: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Overflow.model_validate({"pools": ["a"], **overflow})


def test_an_auto_gate_counts_serving_replicas_and_stays_open_without_a_batch_size() -> None:
    # Records older than the pool's maxAge give no batch size: a gate that turns nothing
    # away (it stays, so its 503 for replicas without a healthy host still goes on to paid).
    stale = _auto_plan({"default": 1}, at=900.0)
    assert _gate_limits(stale) == {GATE_OPEN} and stale.gate_auto["main/chat"] == (0, 1)
    # A draining replica takes no new request: its slots are not the gate's.
    draining = Endpoint.model_validate({"address": "127.0.0.1", "port": 8002, "health": "draining"})
    drained = _auto_plan({"default": 1}, registered={"owned": {"127.0.0.1:8002": draining}})
    assert _gate_limits(drained) == {14} and drained.gate_auto["main/chat"] == (16, 1)
    assert Overflow.model_validate({"pools": ["a"], "maxInFlight": "auto"}).max_in_flight == "auto"
    with pytest.raises(ValidationError, match="maxInFlight") as error:
        Overflow.model_validate({"pools": ["a"], "maxInFlight": "automatic"})
    assert "'auto'" in str(error.value)


def test_the_gate_is_an_internal_listener_in_front_of_a_breaker_at_the_limit() -> None:
    out = _resources(_route())
    clusters = {c.name: c for c in out.clusters}
    behind = clusters["main/chat/gate/replicas"]
    assert behind.circuit_breakers.thresholds[0].max_requests.value == 16
    # The same EDS resource as the replicas' own cluster, hashed as the session entry is.
    assert behind.eds_cluster_config.service_name == "main/chat"
    assert behind.lb_policy == behind.RING_HASH
    # At the limit no replica holds more than the mean: its batch, where the limit is the
    # replicas' batch slots.
    assert behind.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value == 100
    to_gate = clusters["main/chat/gate"]
    address = to_gate.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address
    assert address.envoy_internal_address.server_listener_name == "main/chat/gate"

    gate = next(listener for listener in out.listeners if listener.name == "main/chat/gate")
    assert gate.HasField("internal_listener")
    manager = _manager(gate)
    route = manager.route_config.virtual_hosts[0].routes[0]
    assert route.route.cluster == "main/chat/gate/replicas"
    assert [h.header.header_name for h in route.route.hash_policy] == ["x-session-id"]
    assert route.response_headers_to_add[0].header.key == GATE_UPSTREAM
    mapper = manager.local_reply_config.mappers[0]
    assert list(mapper.filter.response_flag_filter.flags) == ["UO"]
    assert mapper.headers_to_add[0].header.key == GATE_HEADER
    # Should the retries run out, the client gets the 503 in OpenAI's format.
    assert mapper.body_format_override.json_format["error"]["code"]
    # Envoy's own overload header would forbid the retry.
    router = router_pb2.Router()
    manager.http_filters[-1].typed_config.Unpack(router)
    assert router.suppress_envoy_headers


@pytest.mark.parametrize("balancing", ["least_request", "telemetry", "round_robin"])
def test_without_affinity_least_request_behind_the_gate_scans_every_replica(
    balancing: str,
) -> None:
    route = {**_route(), "balancing": balancing}
    del route["sessionAffinity"]
    behind = {c.name: c for c in _resources(route).clusters}["main/chat/gate/replicas"]
    assert behind.circuit_breakers.thresholds[0].max_requests.value == 16
    if balancing != "least_request":
        # Unequal weights (telemetry) are an EDF schedule in Envoy whatever the selection;
        # round robin is kept as asked.
        assert not behind.HasField("load_balancing_policy")
        assert behind.common_lb_config.HasField("locality_weighted_lb_config")
        return
    assert len(behind.load_balancing_policy.policies) == 1
    extension = behind.load_balancing_policy.policies[0].typed_extension_config
    assert extension.name == "envoy.load_balancing_policies.least_request"
    config = least_request_pb2.LeastRequest()
    extension.typed_config.Unpack(config)
    assert config.selection_method == config.FULL_SCAN
    # Pools sharing a tier keep their locality weights, inside the policy (Envoy refuses
    # them beside it).
    assert config.locality_lb_config.HasField("locality_weighted_lb_config")
    assert not behind.common_lb_config.HasField("locality_weighted_lb_config")


def _manager(listener: Any) -> Any:
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    return manager


def test_plain_requests_go_on_to_paid_and_conversations_wait_for_their_replica() -> None:
    out = _resources(_route())
    clusters = {c.name: c for c in out.clusters}
    entries = _entries(out)

    plain = entries["main/chat#0"]
    assert plain.route.cluster == "main/chat/overflow/cheap/gate"
    assert _members(clusters["main/chat/overflow/cheap/gate"]) == [
        "main/chat/gate",
        "main/chat/provider/cheap",
        "main/chat",
    ]
    assert plain.route.auto_host_rewrite.value
    _assert_retries_on_the_gate(plain, tries=1)

    session = entries["main/chat#0/affinity"]
    assert session.route.cluster == "main/chat/affinity/gate"
    assert _members(clusters["main/chat/affinity/gate"]) == ["main/chat/gate", "main/chat/affinity"]
    _assert_retries_on_the_gate(session, tries=SESSION_TRIES)
    # Every spilled request is a retry: the aggregates do not cap them at Envoy's 3.
    for name in ("main/chat/overflow/cheap/gate", "main/chat/affinity/gate"):
        assert clusters[name].circuit_breakers.thresholds[0].max_retries.value == GATE_RETRIES


def _members(cluster: Any) -> list[str]:
    config = aggregate_pb2.ClusterConfig()
    cluster.cluster_type.typed_config.Unpack(config)
    return list(config.clusters)


def _assert_retries_on_the_gate(entry: Any, *, tries: int) -> None:
    policy_ = entry.route.retry_policy
    assert "retriable-headers" in policy_.retry_on.split(",")
    assert [h.name for h in policy_.retriable_headers] == [GATE_HEADER]
    assert policy_.num_retries.value == 2 + tries  # the route's two retries, and the gate's
    config = previous_priorities_config_pb2.PreviousPrioritiesConfig()
    policy_.retry_priority.typed_config.Unpack(config)
    assert config.update_frequency == tries


def test_conversations_with_the_rest_go_on_to_paid_too() -> None:
    out = _resources(_route(conversations="with"))
    session = _entries(out)["main/chat#0/affinity"]
    assert session.route.cluster == "main/chat/overflow/cheap/gate"
    _assert_retries_on_the_gate(session, tries=1)


def test_a_prompt_prefix_key_is_gated_and_hashed_behind_the_gate() -> None:
    route = _route()
    route["sessionAffinity"] = {"header": "x-session-id", "prefixHashChars": 256}
    out = _resources(route)
    prefix = _entries(out)["main/chat#0/prefix"]
    assert prefix.route.cluster == "main/chat/overflow/cheap/gate"
    gate = next(listener for listener in out.listeners if listener.name == "main/chat/gate")
    hashed = _manager(gate).route_config.virtual_hosts[0].routes[0].route.hash_policy
    assert [h.header.header_name for h in hashed] == ["x-session-id", PREFIX_KEY_HEADER]


def test_no_gate_without_a_limit_or_with_a_provider_among_the_tiers() -> None:
    for route in (
        {**_route(), "overflow": {"pools": ["cheap"], "signal": "fill"}},
        {**_route(), "tiers": [["owned"], ["backup"]]},
    ):
        out = _resources(route, _paid("backup", 9445))
        names = {c.name for c in out.clusters} | {listener.name for listener in out.listeners}
        assert not any("/gate" in name for name in names), names
        entries = _entries(out)
        assert not any(GATE_HEADER in str(e.route.retry_policy) for e in entries.values())


def test_the_usage_filter_keeps_the_replica_for_the_log_and_the_book_prices_it() -> None:
    # The usage filter moves the gate's header into the metadata and off the answer.
    assert f'headers():remove("{GATE_UPSTREAM}")' in USAGE_LUA
    assert 'set(NS, "upstream", upstream)' in USAGE_LUA

    class Context:
        def pool(self, cluster: str, address: str, port: int) -> str | None:
            return "owned" if (cluster, address, port) == ("main/chat", "10.0.0.1", 8001) else None

        def price(self, pool: str) -> None:
            return None

        def tenant_header(self, route: str) -> str:
            return ""

    book = UsageBook(Context())
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.upstream_cluster = "main/chat/overflow/cheap/gate"
    common.route_name = "main/chat#0"
    common.upstream_remote_address.envoy_internal_address.server_listener_name = "main/chat/gate"
    fields = common.metadata.filter_metadata[USAGE_FILTER]
    fields.update({"prompt": 10, "completion": 5, "upstream": "10.0.0.1:8001"})
    book.observe(entry)
    assert [key.pool for key in book.ledger.totals] == ["owned"]
