"""Validation of the new policy fields: a route's model source and adapter fallback, and a
Fleet's tracing collector. Bad input gets an error naming the field."""

from __future__ import annotations

import pytest

from policies import PolicyError, parse_object


def test_a_route_takes_either_a_model_list_or_its_pools_models() -> None:

    body = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "p"},
        "spec": {
            "listener": {"port": 10000},
            "routes": [
                {"name": "r", "match": {"models": ["m"], "poolModels": True}, "tiers": [["x"]]}
            ],
        },
    }
    with pytest.raises(PolicyError, match="either models or poolModels"):
        parse_object(body)
    body["spec"]["routes"][0]["match"] = {"poolModels": True}
    body["spec"]["routes"][0]["adapters"] = {"fallback": "nowhere"}
    with pytest.raises(PolicyError, match=r"adapters\.fallback"):
        parse_object(body)


@pytest.mark.parametrize(
    ("collector", "message"),
    [
        ("otel:99999", "port must be 1-65535"),
        ("otel", "should match pattern"),
        ("a b:1", "pattern"),
    ],
)
def test_a_fleet_tracing_collector_must_be_host_and_port(collector: str, message: str) -> None:
    body = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Fleet",
        "metadata": {"name": "default"},
        "spec": {"tracing": {"collector": collector}},
    }
    with pytest.raises(PolicyError, match=message):
        parse_object(body)
