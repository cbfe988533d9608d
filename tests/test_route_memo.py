"""`RouteMemo` reuses a compiled route only while every input it reads is unchanged.

Each case changes one input of a route, as the reconciler would (the changed object is new,
every other object is the very one of the last compile), and checks that compiling with the
memo of the last compile gives exactly the plan a fresh compile gives. A case that did not
change the plan at all would prove nothing, so each also checks that the plan moved.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import pytest
from harness.builders import service_classes

from compiler import RouteMemo, compile_plan
from policies import Endpoint, parse_object
from policies.models import PolicyObject
from signals import PolicyState
from signals.telemetry import TelemetryRecord

NOW = 1_000_000.0


def _pool(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.io/v1", "kind": "Pool", "metadata": {"name": name}, "spec": spec}


BASE_DOCS: dict[str, dict[str, Any]] = {
    "a": _pool(
        "a",
        {
            "models": ["m"],
            "endpoints": [
                {"address": "10.0.0.1", "port": 8000},
                {"address": "10.0.0.2", "port": 8000, "weight": 50},
            ],
            "telemetry": {"format": "vllm", "maxAge": "10s"},
        },
    ),
    "b": _pool("b", {"models": ["m"], "endpoints": [{"address": "10.0.1.1", "port": 8000}]}),
    "c": _pool("c", {"endpoints": [{"address": "10.0.2.1", "port": 8000}]}),
    "d": _pool(
        "d",
        {
            "endpoints": [{"address": "10.0.3.1", "port": 8000}],
            "telemetry": {"format": "vllm", "maxAge": "10s"},
        },
    ),
    "p": {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "p"},
        "spec": {
            "listener": {"port": 10000},
            "serviceClasses": {
                "tenantHeader": "x-tenant",
                "defaultClass": "interactive",
                **service_classes(whenSaturated="shed", retryAfter="30s"),
            },
            "routes": [
                {
                    "name": "chat",
                    "match": {"models": ["m"]},
                    "tiers": [[{"pool": "a", "weight": 90}, {"pool": "b", "weight": 10}], ["c"]],
                    "sessionAffinity": {"header": "x-session-id", "hashBalanceFactor": 150},
                },
                {"name": "rest", "match": {"pathPrefix": "/v1/"}, "tiers": [["b"]]},
                # Telemetry weights are worked out anew on every compile, so this route is
                # compiled every time; the two above are the ones the memo keeps.
                {
                    "name": "live",
                    "match": {"models": ["live"]},
                    "tiers": [["a"]],
                    "balancing": "telemetry",
                },
                # Telemetry with session affinity: the bound its session entries take follows
                # its replicas' batch fill (``signals.saturation``).
                {
                    "name": "sticky",
                    "match": {"models": ["sticky"]},
                    "tiers": [["d"]],
                    "balancing": "telemetry",
                    "sessionAffinity": {},
                },
            ],
        },
    },
}
BASE_OBJECTS: dict[str, PolicyObject] = {
    name: parse_object(doc, source=name) for name, doc in BASE_DOCS.items()
}
BASE_REGISTERED: dict[str, Mapping[str, Endpoint]] = {
    "b": MappingProxyType({"r1": Endpoint(address="10.0.1.2", port=8000)})
}


def _record(waiting: float, kv_cache: float) -> TelemetryRecord:
    return TelemetryRecord(at=NOW - 1, waiting=waiting, running=8, kv_cache=kv_cache)


BASE_TELEMETRY: dict[str, Mapping[str, TelemetryRecord]] = {
    "a": MappingProxyType({"10.0.0.1:8000": _record(1, 0.3), "10.0.0.2:8000": _record(1, 0.3)})
}


def state(
    docs: Mapping[str, dict[str, Any]] = MappingProxyType({}),
    registered: Mapping[str, Mapping[str, Endpoint]] = MappingProxyType({}),
    telemetry: Mapping[str, Mapping[str, TelemetryRecord]] = MappingProxyType({}),
) -> PolicyState:
    """The base state with `docs` parsed anew and the given pools' registered endpoints and
    telemetry replaced; every other object is the base's own (as the reconciler keeps them)."""
    objects = {**BASE_OBJECTS, **{n: parse_object(d, source=n) for n, d in docs.items()}}
    return PolicyState.from_objects(
        objects.values(),
        registered={**BASE_REGISTERED, **registered},
        telemetry={**BASE_TELEMETRY, **telemetry},
        now=NOW,
    )


def edit(name: str, change: Callable[[dict[str, Any]], object]) -> dict[str, dict[str, Any]]:
    """A copy of base document `name` with `change` applied to its spec."""
    doc = copy.deepcopy(BASE_DOCS[name])
    change(doc["spec"])
    return {name: doc}


def chat(spec: dict[str, Any]) -> dict[str, Any]:
    route: dict[str, Any] = spec["routes"][0]
    return route


CASES: dict[str, Callable[[], PolicyState]] = {
    # every field of the pools a route reads
    "pool connect timeout": lambda: state(edit("a", lambda s: s.update(connectTimeout="2s"))),
    "pool health check": lambda: state(edit("a", lambda s: s.update(healthCheck={"path": "/h"}))),
    "pool outlier detection": lambda: state(
        edit("a", lambda s: s.update(outlierDetection={"consecutive5xx": 9}))
    ),
    "pool circuit breakers": lambda: state(
        edit("a", lambda s: s.update(circuitBreakers={"maxRequests": 7}))
    ),
    "pool protocol": lambda: state(edit("a", lambda s: s.update(protocol="http2"))),
    "pool host rewrite": lambda: state(edit("b", lambda s: s.update(hostRewrite="b.local"))),
    "pool models": lambda: state(edit("b", lambda s: s.update(models=["m", "n"]))),
    "pool endpoint added": lambda: state(
        edit("c", lambda s: s["endpoints"].append({"address": "10.0.2.2", "port": 8000}))
    ),
    "pool endpoint weight": lambda: state(edit("c", lambda s: s["endpoints"][0].update(weight=7))),
    "pool endpoint health": lambda: state(
        edit("c", lambda s: s["endpoints"][0].update(health="draining"))
    ),
    "pool endpoint locality": lambda: state(
        edit("c", lambda s: s["endpoints"][0].update(locality={"region": "r1", "zone": "z1"}))
    ),
    "pool telemetry max age": lambda: state(
        edit("a", lambda s: s.update(telemetry={"format": "vllm", "maxAge": "0.5s"}))
    ),
    "pool deleted": lambda: PolicyState.from_objects(
        [o for n, o in BASE_OBJECTS.items() if n != "c"],
        registered=BASE_REGISTERED,
        telemetry=BASE_TELEMETRY,
        now=NOW,
    ),
    # registered endpoints
    "registered endpoint added": lambda: state(
        registered={
            "b": MappingProxyType(
                {**BASE_REGISTERED["b"], "r2": Endpoint(address="10.0.1.3", port=8000)}
            )
        }
    ),
    "registered endpoint weight": lambda: state(
        registered={
            "b": MappingProxyType({"r1": Endpoint(address="10.0.1.2", port=8000, weight=3)})
        }
    ),
    "registered endpoint in another pool": lambda: state(
        registered={"c": MappingProxyType({"r3": Endpoint(address="10.0.2.9", port=8000)})}
    ),
    # telemetry: weights of a telemetry-balanced route, and admission of its service classes
    "telemetry weights": lambda: state(
        telemetry={
            "a": MappingProxyType(
                {"10.0.0.1:8000": _record(30, 0.9), "10.0.0.2:8000": _record(0, 0.1)}
            )
        }
    ),
    "telemetry saturates the first tier (admission)": lambda: state(
        telemetry={
            "a": MappingProxyType(
                {"10.0.0.1:8000": _record(500, 0.99), "10.0.0.2:8000": _record(500, 0.99)}
            ),
            "b": MappingProxyType({"10.0.1.1:8000": _record(500, 0.99)}),
        }
    ),
    "telemetry fills the batches (saturated bound)": lambda: state(
        telemetry={
            "d": MappingProxyType(
                {"10.0.3.1:8000": TelemetryRecord(at=NOW - 1, running=8, max_running=8)}
            ),
        }
    ),
    # every field of the route, and the policy around it
    "route match": lambda: state(edit("p", lambda s: chat(s)["match"].update(models=["m", "x"]))),
    "route path prefix": lambda: state(
        edit("p", lambda s: chat(s)["match"].update(pathPrefix="/v2/"))
    ),
    "route headers": lambda: state(
        edit("p", lambda s: chat(s)["match"].update(headers=[{"name": "x-a", "value": "1"}]))
    ),
    "route session affinity": lambda: state(
        edit("p", lambda s: chat(s)["sessionAffinity"].update(hashBalanceFactor=200))
    ),
    "route retries": lambda: state(edit("p", lambda s: chat(s).update(retries={"attempts": 5}))),
    "route timeouts": lambda: state(
        edit("p", lambda s: chat(s).update(timeouts={"request": "7s"}))
    ),
    "route rate limit": lambda: state(
        edit("p", lambda s: chat(s).update(rateLimit={"requests": 5, "unit": "second"}))
    ),
    "route balancing": lambda: state(edit("p", lambda s: chat(s).update(balancing="random"))),
    "route balancing by telemetry": lambda: state(
        edit("p", lambda s: chat(s).update(balancing="telemetry"))
    ),
    "route service class": lambda: state(edit("p", lambda s: chat(s).update(serviceClass="batch"))),
    "rollout weights (tier split)": lambda: state(
        edit("p", lambda s: chat(s)["tiers"][0][1].update(weight=25))
    ),
    "route tiers": lambda: state(edit("p", lambda s: chat(s)["tiers"].pop())),
    "route order": lambda: state(edit("p", lambda s: s["routes"].reverse())),
    "policy service classes": lambda: state(
        edit("p", lambda s: s["serviceClasses"]["classes"][1].update(retryAfter="5s"))
    ),
    "policy tenant header": lambda: state(
        edit("p", lambda s: s["serviceClasses"].update(tenantHeader="x-org"))
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_memoized_compile_equals_a_fresh_one_after_one_input_changes(case: str) -> None:
    base = state()
    memo = RouteMemo()
    before = compile_plan(base, memo)
    assert compile_plan(base, memo) == before  # the memo alone changes nothing

    changed = CASES[case]()
    fresh = compile_plan(changed)
    assert fresh != before, "this case does not change the plan, so it checks nothing"
    assert compile_plan(changed, memo) == fresh
