"""An endpoint's ``name`` becomes its place on the hash ring (``envoy.lb`` ``hash_key``);
two replicas of one pool may not share one."""

from __future__ import annotations

from typing import Any

import pytest

from compiler import compile_plan
from policies import PolicyError
from policies.validate import parse_object
from signals import PolicyState
from xdsserver.translate import translate


def _objects(endpoints: list[dict[str, Any]]) -> list[Any]:
    pool = {"kind": "Pool", "metadata": {"name": "p"}, "spec": {"endpoints": endpoints}}
    route = {"name": "chat", "tiers": [["p"]], "sessionAffinity": {}}
    routing = {
        "kind": "RoutingPolicy",
        "metadata": {"name": "r"},
        "spec": {"listener": {"port": 10000}, "routes": [route]},
    }
    return [parse_object(pool), parse_object(routing)]


def _hash_keys(endpoints: list[dict[str, Any]]) -> dict[int, str | None]:
    plan = compile_plan(PolicyState.from_objects(_objects(endpoints)))
    (assignment,) = translate(plan.fleets[0]).endpoints
    out: dict[int, str | None] = {}
    for locality in assignment.endpoints:
        for lb in locality.lb_endpoints:
            lb_meta = lb.metadata.filter_metadata.get("envoy.lb")
            key = lb_meta.fields["hash_key"].string_value if lb_meta is not None else None
            out[lb.endpoint.address.socket_address.port_value] = key
    return out


def test_a_named_endpoint_is_hashed_by_its_name_and_an_unnamed_one_by_its_address() -> None:
    keys = _hash_keys(
        [
            {"address": "10.0.0.1", "port": 8000, "name": "replica-0"},
            {"address": "10.0.0.1", "port": 8001},
        ]
    )
    assert keys == {8000: "replica-0", 8001: None}


def test_two_endpoints_of_one_pool_may_not_share_a_name() -> None:
    with pytest.raises(PolicyError, match="used twice"):
        _objects(
            [
                {"address": "10.0.0.1", "port": 8000, "name": "a"},
                {"address": "10.0.0.2", "port": 8000, "name": "a"},
            ]
        )
