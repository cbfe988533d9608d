"""Each golden case pins its feature: one field of the case's input changed, the rendered
resources differ from the golden files, in the resource type that carries the feature.

A case whose feature's translation could change without its golden files noticing (a field
that no longer reaches Envoy, a signal that no longer moves a weight) fails here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from harness.golden import OUT, case_document, load_case, render_case, set_field

from xdsserver.render import parse_render_input

TELEMETRY_BUSY = ("telemetry", "mistral", "10.0.0.2:8000")
SATURATED = ("telemetry", "mistral", "10.0.0.1:8000")

# feature (a row of the README's feature table, or a part of one), case, field, new value,
# the resource types that must change.
MUTATIONS: list[tuple[str, str, tuple[Any, ...], Any, set[str]]] = [
    (
        "locality per fleet",
        "regions-locality",
        ("objects", 2, "spec", "locality", "zone"),
        "us-east-b",
        {"endpoints"},
    ),
    (
        "locality spill under saturation",
        "regions-spill",
        ("telemetry", "llama", "10.0.1.1:8000"),
        {"at": 999.5, "running": 4, "max_running": 16},
        {"endpoints"},
    ),
    (
        "spill by arrivals: the located fleets' arrivals log",
        "regions-locality",
        ("objects", 2, "spec", "spillSignal"),
        "fill",
        {"listeners"},
    ),
    (
        "overflow by arrivals: the arrivals log on its route's listener",
        "overflow-arrivals",
        ("objects", 2, "spec", "routes", 0, "overflow", "signal"),
        "fill",
        {"listeners"},
    ),
    (
        "the gate of the owned replicas: its breaker's limit",
        "overflow-gate",
        ("objects", 2, "spec", "routes", 0, "overflow", "maxInFlight"),
        24,
        {"clusters"},
    ),
    (
        "the gate of the owned replicas: its internal listener and the entries through it",
        "overflow-gate",
        ("objects", 2, "spec", "routes", 0, "overflow", "maxInFlight"),
        None,
        {"clusters", "listeners", "routes"},
    ),
    (
        "spot preference",
        "regions-spot",
        ("objects", 0, "spec", "preferCapacity"),
        ["on-demand", "spot"],
        {"endpoints"},
    ),
    (
        "spot preference by price",
        "regions-spot",
        ("objects", 0, "spec", "price"),
        {"replicaHour": "4.20", "byCapacity": {"on-demand": "1.00", "spot": "2.00"}},
        {"endpoints"},
    ),
    (
        "failover tiers",
        "failover-tiers",
        ("objects", 3, "spec", "routes", 0, "tiers"),
        [["primary"], ["secondary"]],
        {"endpoints"},
    ),
    (
        "active health checks",
        "failover-tiers",
        ("objects", 0, "spec", "healthCheck", "interval"),
        "5s",
        {"clusters"},
    ),
    (
        "outlier detection",
        "failover-tiers",
        ("objects", 0, "spec", "outlierDetection", "consecutive5xx"),
        5,
        {"clusters"},
    ),
    (
        "retries",
        "failover-tiers",
        ("objects", 3, "spec", "routes", 0, "retries", "attempts"),
        1,
        {"routes"},
    ),
    (
        "rollout split",
        "rollout-split",
        ("objects", 2, "spec", "routes", 0, "tiers", 0, "pools", 1, "weight"),
        25,
        {"endpoints"},
    ),
    (
        "rollout fleet weights",
        "rollout-fleet-weights",
        ("objects", 2, "spec", "routes", 0, "tiers", 0, "fleetWeights", "canary-east", "canary"),
        20,
        {"endpoints"},
    ),
    (
        "rollout upstream signals",
        "rollout-fleet-weights",
        ("objects", 3, "spec", "target", "route"),
        "other",
        {"listeners"},
    ),
    (
        "session affinity bounded load",
        "session-affinity-ring-hash",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "hashBalanceFactor"),
        200,
        {"clusters"},
    ),
    (
        "session affinity header",
        "session-affinity-ring-hash",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "header"),
        "x-user",
        {"routes"},
    ),
    (
        "session affinity replica names",
        "session-affinity-ring-hash",
        ("objects", 0, "spec", "endpoints", 0, "name"),
        "llama-9",
        {"endpoints"},
    ),
    (
        "maglev",
        "session-affinity-maglev",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "algorithm"),
        "ring_hash",
        {"clusters"},
    ),
    (
        "prompt-prefix affinity",
        "prefix-affinity",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "prefixHashChars"),
        512,
        {"routes"},
    ),
    (
        "hot prompt prefixes spread",
        "hot-prefix-spread",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "hotPrefixShare"),
        40,
        {"routes"},
    ),
    (
        "model routing",
        "model-routing",
        ("objects", 2, "spec", "routes", 0, "match", "models"),
        ["llama-3.3-70b"],
        {"routes"},
    ),
    (
        "model header",
        "model-routing",
        ("objects", 2, "spec", "modelHeader"),
        "x-llm",
        {"routes"},
    ),
    (
        "model list",
        "model-list",
        ("objects", 0, "spec", "models"),
        ["mistral-7b"],
        {"routes"},
    ),
    (
        "balancing",
        "balancing-static",
        ("objects", 1, "spec", "routes", 0, "balancing"),
        "least_request",
        {"clusters"},
    ),
    (
        "static endpoint weights",
        "balancing-static",
        ("objects", 0, "spec", "endpoints", 0, "weight"),
        100,
        {"endpoints"},
    ),
    (
        "orca balancing",
        "balancing-orca",
        ("objects", 1, "spec", "routes", 0, "balancing"),
        "round_robin",
        {"clusters"},
    ),
    (
        "telemetry weights",
        "telemetry-weights",
        (*TELEMETRY_BUSY, "waiting"),
        0,
        {"endpoints"},
    ),
    (
        "telemetry age (the clock)",
        "telemetry-weights",
        ("now",),
        1010.0,
        {"endpoints"},
    ),
    (
        "capacity weights behind session affinity (history)",
        "telemetry-capacity",
        ("history", 1, "telemetry", "llama", "10.0.0.3:8000", "time_per_output_token"),
        0.02,
        {"endpoints"},
    ),
    (
        "saturated twin",
        "saturated-twin",
        (*SATURATED, "running"),
        2,
        {"routes"},
    ),
    (
        "saturated bound",
        "saturated-twin",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "saturatedHashBalanceFactor"),
        110,
        {"clusters"},
    ),
    (
        "capacity bound: the rung follows the requests in flight",
        "capacity-bound",
        (*SATURATED, "running"),
        30,
        {"routes"},
    ),
    (
        "capacity bound: the batch size",
        "capacity-bound",
        (*SATURATED, "max_running"),
        128,
        {"routes"},
    ),
    (
        "capacity bound off: two fixed bounds",
        "capacity-bound",
        ("objects", 1, "spec", "routes", 0, "sessionAffinity", "capacityBound"),
        False,
        {"clusters", "routes"},
    ),
    (
        "capacity bound at small batches: the fixed bounds' decisions",
        "capacity-bound-small",
        (*TELEMETRY_BUSY, "running"),
        2,
        {"routes"},
    ),
    (
        "capacity bound at small batches: the ladder from batches above 16",
        "capacity-bound-small",
        (*TELEMETRY_BUSY, "max_running"),
        64,
        {"clusters", "routes"},
    ),
    (
        "saturation calm",
        "saturation-calm",
        (*SATURATED, "waiting"),
        20,
        {"routes"},
    ),
    (
        "saturation dwell (the clock)",
        "saturation-dwell",
        ("now",),
        2004.0,
        {"routes"},
    ),
    (
        "admission entries (shed)",
        "admission-shed",
        ("now",),
        3010.0,
        {"routes"},
    ),
    (
        "admission entries (divert)",
        "admission-divert",
        ("telemetry", "llama", "10.0.0.1:8000", "ttft"),
        0.2,
        {"routes"},
    ),
    (
        "service classes",
        "example-service-classes",
        ("objects", 2, "spec", "serviceClasses", "classes", 1, "match", "headers", 0, "value"),
        "normal",
        {"routes"},
    ),
    (
        "class budgets",
        "class-budgets",
        ("objects", 1, "spec", "serviceClasses", "classes", 2, "budget", "requests"),
        60,
        {"routes"},
    ),
    (
        "class queue",
        "class-budgets",
        ("objects", 1, "spec", "serviceClasses", "classes", 1, "queue", "concurrency"),
        8,
        {"clusters"},
    ),
    (
        "streaming timeouts",
        "streaming-timeouts",
        ("objects", 1, "spec", "routes", 0, "timeouts", "request"),
        "300s",
        {"routes"},
    ),
    (
        "rate limits",
        "rate-limits",
        ("objects", 1, "spec", "routes", 0, "rateLimit", "requests"),
        10,
        {"routes"},
    ),
    (
        "circuit breakers",
        "circuit-breakers",
        ("objects", 0, "spec", "circuitBreakers", "maxRequests"),
        512,
        {"clusters"},
    ),
    (
        "external providers",
        "external-provider",
        ("objects", 1, "spec", "tls", "sni"),
        "edge.provider.example",
        {"clusters"},
    ),
    (
        "provider credential",
        "external-provider",
        ("objects", 1, "spec", "auth", "header"),
        "x-api-key",
        {"listeners"},
    ),
    (
        "fleet body limit",
        "fleets",
        ("objects", 3, "spec", "maxRequestBodyBytes"),
        1048576,
        {"listeners"},
    ),
    (
        "fleet scoping",
        "fleets",
        ("objects", 2, "spec", "fleets"),
        ["default"],
        {"listeners"},
    ),
    (
        "registered endpoints",
        "registered-endpoints",
        ("endpoints", "pool", 0, "health"),
        "healthy",
        {"endpoints"},
    ),
    (
        "adapter loaded on one more replica",
        "adapter-routing",
        ("telemetry", "llama", "10.0.0.2:8000", "adapters"),
        ["chat-lora", "sql-lora"],
        {"endpoints"},
    ),
    (
        "adapter fallback",
        "adapter-fallback-base",
        ("objects", 2, "spec", "routes", 0, "adapters"),
        {"fallback": "notFound"},
        {"routes"},
    ),
    (
        "tracing sampling",
        "tracing",
        ("objects", 0, "spec", "tracing", "sampling"),
        50,
        {"listeners"},
    ),
    (
        "virtual model over three targets",
        "virtual-models-targets",
        ("objects", 3, "spec", "virtualModels", 0, "targets", 1, "threshold"),
        0.55,
        {"routes"},
    ),
]


@pytest.mark.parametrize(
    ("feature", "case", "path", "value", "kinds"),
    MUTATIONS,
    ids=[row[0] for row in MUTATIONS],
)
def test_changing_the_feature_changes_its_golden_files(
    feature: str, case: str, path: tuple[Any, ...], value: Any, kinds: set[str]
) -> None:
    golden = render_case(case, load_case(case))
    assert all((OUT / name).read_text() == text for name, text in golden.items()), (
        f"case {case} does not match its golden files: run tests/test_translate_golden.py"
    )
    document = copy.deepcopy(case_document(case))
    set_field(document, path, value)
    mutated = render_case(case, parse_render_input(document, source=f"{case}.yaml"))
    changed = {
        name.rsplit(".", 2)[-2]
        for name in golden.keys() | mutated.keys()
        if golden.get(name) != mutated.get(name)
    }
    assert changed, f"{feature}: setting {path} to {value!r} changes no golden file of {case}"
    assert kinds <= changed, f"{feature}: expected {sorted(kinds)} to change, got {sorted(changed)}"


def test_every_case_but_the_examples_is_mutated() -> None:
    """A new case comes with its mutation row here."""
    from harness.golden import case_names

    mutated = {row[1] for row in MUTATIONS}
    missing = [c for c in case_names() if c not in mutated and not c.startswith("example-")]
    assert not missing, f"cases without a mutation in MUTATIONS: {missing}"
