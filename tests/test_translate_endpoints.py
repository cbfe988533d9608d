"""ClusterLoadAssignments, built from each endpoint's cached encoding: the same message as one
built field by field, for every kind of endpoint."""

from __future__ import annotations

import dataclasses

from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import json_format, wrappers_pb2

from compiler import compile_plan
from compiler.plan import PlanCluster, PlanEndpoint
from controlplane.local import repo_root
from policies import load_objects
from signals import PolicyState
from xdsserver.translate.clusters import _varint, translate_endpoints


def a_cluster() -> PlanCluster:
    state = PolicyState.from_objects(
        load_objects(repo_root() / "policies" / "examples" / "llm-fleet.yaml")
    )
    plan = compile_plan(state)
    return next(c for f in plan.fleets for c in f.clusters if c.kind == "eds")


ENDPOINTS = (
    PlanEndpoint("a", "10.0.0.1", 8000, 100, 0),
    PlanEndpoint("a", "10.0.0.2", 8001, 0, 0, "draining"),
    PlanEndpoint("a", "10.0.0.3", 8000, 7, 0, "unhealthy", hash_key="replica-3"),
    PlanEndpoint("b", "10.0.1.1", 9000, 300, 0, "degraded", "us-east1", "b"),
    PlanEndpoint("p", "203.0.113.9", 443, 1, 1, hostname="api.example", hash_key="x"),
)


def expected() -> dict[str, object]:
    def lb(address: str, port: int, weight: int, health: str, **extra: object) -> dict[str, object]:
        return {
            "endpoint": {"address": {"socket_address": {"address": address, "port_value": port}}}
            | ({"hostname": extra["hostname"]} if "hostname" in extra else {}),
            "health_status": health,
            "load_balancing_weight": weight,  # a wrapper: present even at 0
        } | (
            {"metadata": {"filter_metadata": {"envoy.lb": {"hash_key": extra["hash_key"]}}}}
            if "hash_key" in extra
            else {}
        )

    return {
        "cluster_name": "c",
        "endpoints": [
            {
                "locality": {"sub_zone": "a"},
                "lb_endpoints": [
                    lb("10.0.0.1", 8000, 100, "HEALTHY"),
                    lb("10.0.0.2", 8001, 0, "DRAINING"),
                    lb("10.0.0.3", 8000, 7, "UNHEALTHY", hash_key="replica-3"),
                ],
                "load_balancing_weight": 107,
            },
            {
                "locality": {"region": "us-east1", "zone": "b", "sub_zone": "b"},
                "lb_endpoints": [lb("10.0.1.1", 9000, 300, "DEGRADED")],
                "load_balancing_weight": 300,
            },
            {
                "locality": {"sub_zone": "p"},
                "lb_endpoints": [
                    lb("203.0.113.9", 443, 1, "HEALTHY", hostname="api.example", hash_key="x")
                ],
                "load_balancing_weight": 1,
                "priority": 1,
            },
        ],
    }


def test_a_load_assignment_holds_each_endpoint_as_built_field_by_field() -> None:
    cluster = dataclasses.replace(a_cluster(), name="c", eds_service="", endpoints=ENDPOINTS)
    want = json_format.ParseDict(expected(), endpoint_pb2.ClusterLoadAssignment())
    for _ in range(2):  # built, then from the cache
        got = translate_endpoints(cluster)
        assert got == want, json_format.MessageToDict(got, preserving_proto_field_name=True)
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(
            deterministic=True
        )


def test_a_changed_endpoint_is_encoded_anew() -> None:
    cluster = dataclasses.replace(a_cluster(), name="c", eds_service="", endpoints=ENDPOINTS[:1])
    translate_endpoints(cluster)
    moved = dataclasses.replace(cluster, endpoints=(ENDPOINTS[0]._replace(weight=55),))
    [locality] = translate_endpoints(moved).endpoints
    assert [e.load_balancing_weight.value for e in locality.lb_endpoints] == [55]


def test_varint_matches_protobuf() -> None:
    for value in [*range(1, 20_000), 2**21, 2**31, 2**40]:
        # A UInt64Value holding it is field 1, varint: key 0x08, then the encoding.
        assert b"\x08" + _varint(value) == wrappers_pb2.UInt64Value(value=value).SerializeToString()
    assert _varint(0) == b"\x00"
