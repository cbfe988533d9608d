"""Service classes: validation with field paths, the admission controller's steps and
hysteresis, and what a decision becomes in Envoy's route configuration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from compiler import compile_plan
from controlplane.local import find_binary, repo_root
from policies import PolicyError, load_objects, parse_object
from policies.models import Endpoint, Saturation, ServiceClass, ServiceClasses
from signals import PolicyState
from signals.admission import (
    AdmissionDecision,
    decide,
    pool_pressure,
    pool_signals,
    pressure_of,
)
from signals.telemetry import TelemetryRecord
from xdsserver.static import validate_with_envoy
from xdsserver.translate import translate
from xdsserver.translate.listeners import SHED_STATUS

EXAMPLE = repo_root() / "policies" / "examples" / "service-classes.yaml"


def _policy(classes: dict[str, Any], routes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "kind": "RoutingPolicy",
        "metadata": {"name": "p"},
        "spec": {
            "serviceClasses": classes,
            "routes": routes or [{"name": "chat", "tiers": [["a"]]}],
        },
    }


INTERACTIVE = {"name": "interactive", "objective": {"ttft": "1s"}}
BATCH = {"name": "batch", "objective": {"ttft": "60s"}, "whenSaturated": "shed"}


@pytest.mark.parametrize(
    ("document", "path", "words"),
    [
        (
            _policy(
                {"classes": [INTERACTIVE]}, [{"name": "r", "tiers": [["a"]], "serviceClass": "x"}]
            ),
            "spec.routes[0].serviceClass",
            "'x' is not declared",
        ),
        (
            _policy({"classes": [INTERACTIVE, INTERACTIVE]}),
            "spec.serviceClasses.classes[1].name",
            "declared twice",
        ),
        (
            _policy({"classes": [INTERACTIVE], "defaultClass": "batch"}),
            "spec.serviceClasses.defaultClass",
            "'batch' is not declared",
        ),
        (
            _policy({"classes": [{**BATCH, "whenSaturated": "divert", "divertTo": "nowhere"}]}),
            "spec.serviceClasses.classes[0].divertTo",
            "'nowhere' is not a route",
        ),
        (
            _policy({"classes": [{**BATCH, "whenSaturated": "divert"}]}),
            "spec.serviceClasses.classes[0]",
            "needs divertTo",
        ),
        (
            _policy({"classes": [{**BATCH, "match": {}}]}),
            "spec.serviceClasses.classes[0].match",
            "needs headers or tenants",
        ),
        (
            _policy({"classes": [BATCH], "saturation": {"low": 1.0, "high": 1.0}}),
            "spec.serviceClasses.saturation",
            "low must be below high",
        ),
        (
            _policy({"classes": [{**BATCH, "whenSaturated": "drop"}]}),
            "spec.serviceClasses.classes[0].whenSaturated",
            "'admit', 'shed', 'queue' or 'divert'",
        ),
        (
            _policy({"classes": [{**BATCH, "queue": {"concurrency": 2}}]}),
            "spec.serviceClasses.classes[0]",
            "queue applies only with whenSaturated 'queue'",
        ),
    ],
)
def test_invalid_classes_are_reported_at_their_field(
    document: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_object(document)
    found = {error.path: error.message for error in raised.value.errors}
    assert path in found, found
    assert words in found[path]


SATURATION = Saturation(shed_interval=1.0, recover_interval=3.0)
CLASSES = [
    ServiceClass.model_validate(INTERACTIVE),
    ServiceClass.model_validate({**BATCH, "name": "standard"}),
    ServiceClass.model_validate(BATCH),
]


def _run(pressures: list[float | None], start: AdmissionDecision | None = None) -> list[int]:
    """Levels after one decision per second with these pressures."""
    decision, levels = start, []
    for second, pressure in enumerate(pressures):
        decision = decide(decision, pressure, CLASSES, now=float(second), saturation=SATURATION)
        levels.append(decision.level)
    return levels


def test_saturation_restricts_the_lowest_class_first_by_the_share_the_pressure_implies() -> None:
    # Pressure 1.25: a quarter over high, one step of 25% a second.
    assert _run([1.25] * 3) == [1, 2, 3]
    # 1.5: half of a class at once; the next class up only in the next round, never two
    # classes in one change, and interactive ('admit') is never touched.
    assert _run([1.5] * 5) == [2, 4, 6, 8, 8]
    # 2 and more: a whole class a round.
    assert _run([3.0] * 3) == [4, 8, 8]
    # One step short of the end of batch: the rest of batch, then standard next round.
    assert _run([1.25, 1.25, 1.25, 2.0, 2.0]) == [1, 2, 3, 4, 8]
    decision = None
    for second in range(3):
        decision = decide(decision, 1.5, CLASSES, now=float(second), saturation=SATURATION)
    assert decision is not None
    assert dict(decision.admitted or {}) == {"interactive": 1.0, "standard": 0.5, "batch": 0.0}


def test_a_step_is_at_least_one_and_follows_the_step_size() -> None:
    # Just at high: one step. With steps of 10%, pressure 1.5 restricts five of them.
    assert _run([1.0, 1.0]) == [1, 2]
    tenths = Saturation(step=10, shed_interval=1.0, recover_interval=3.0)
    levels = [
        decide(None, pressure, CLASSES, now=0.0, saturation=tenths).level
        for pressure in (1.0, 1.05, 1.5, 1.95, 5.0)
    ]
    assert levels == [1, 1, 5, 10, 10]


def test_nothing_moves_inside_the_band_and_recovery_is_slower_than_shedding() -> None:
    # 0.8 is inside the band (0.5, 1.0): however long it lasts, nothing moves.
    assert _run([1.2, 1.2, *[0.8] * 10]) == [1, 2, *[2] * 10]
    # Below low: one step back once 3 s have passed since the last change, then every 3 s,
    # where shedding took a step every second.
    assert _run([1.2, 1.2, *[0.4] * 8]) == [1, 2, 2, 2, 1, 1, 1, 0, 0, 0]


def test_a_queue_that_is_already_draining_is_not_shed_further() -> None:
    # Pressure still above high but well down since the last step: hold.
    assert _run([1.25, 1.25, 1.1, 1.05, 1.02]) == [1, 2, 2, 2, 2]


def test_without_fresh_telemetry_everything_is_admitted() -> None:
    levels = _run([1.25, 1.25, 1.25, None])
    assert levels == [1, 2, 3, 0]


def test_pool_pressure_is_the_largest_mean_signal_over_fresh_records() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=p) for p in (1, 2, 3)]
    records = {
        "10.0.0.1:1": TelemetryRecord(at=100.0, waiting=6, kv_cache=0.5),
        "10.0.0.1:2": TelemetryRecord(at=100.0, waiting=2, kv_cache=0.5),
        "10.0.0.1:3": TelemetryRecord(at=50.0, waiting=100),  # stale: left out
    }
    pressure = pool_pressure(endpoints, records, now=101.0, max_age=10.0, saturation=SATURATION)
    assert pressure == 1.0  # mean queue 4 over a bound of 4
    assert pool_pressure(endpoints, {}, now=101.0, max_age=10.0, saturation=SATURATION) is None


def test_a_decision_keeps_each_class_since_and_its_next_step_for_operators() -> None:
    decisions = []
    decision = None
    for second, pressure in enumerate([1.25, 1.25, 1.25, 1.25, 1.25, 0.8, 0.4, 0.4, 0.4, 0.4]):
        decision = decide(decision, pressure, CLASSES, now=float(second), saturation=SATURATION)
        decisions.append(decision)
    # Batch went at 0 s and was fully shed at 3 s; standard started to go at 4 s.
    fifth = decisions[4]
    assert dict(fifth.since or {}) == {"interactive": -math.inf, "standard": 4.0, "batch": 3.0}
    assert (fifth.next_step, fifth.next_step_at) == ("restrict", 5.0)
    # Inside the band nothing is due; below low, a step back 3 s after the last change.
    assert (decisions[5].next_step, decisions[5].next_step_at) == (None, math.inf)
    assert (decisions[6].next_step, decisions[6].next_step_at) == ("readmit", 7.0)
    assert decisions[7].level == 4 and dict(decisions[7].since or {})["standard"] == 7.0
    assert dict(decisions[7].since or {})["batch"] == 3.0  # unchanged: still fully shed


def test_pool_signals_give_each_mean_against_its_bound() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=p) for p in (1, 2)]
    records = {
        "10.0.0.1:1": TelemetryRecord(at=100.0, waiting=6, kv_cache=0.75, pending_tokens=3000),
        "10.0.0.1:2": TelemetryRecord(at=100.0, waiting=2, kv_cache=0.25, pending_tokens=1000),
    }
    saturation = Saturation(pending_tokens=4000)
    signals = pool_signals(endpoints, records, now=100.0, max_age=10.0, saturation=saturation)
    assert [(s.name, s.mean, s.bound, s.pressure) for s in signals] == [
        ("queue", 4.0, 4.0, 1.0),
        ("kvCache", 0.5, 0.95, 0.526316),
        ("pendingTokens", 2000.0, 4000.0, 0.5),
    ]
    assert pool_signals(endpoints, records, now=200.0, max_age=10.0, saturation=saturation) == ()


def test_busiest_takes_each_signal_over_the_busiest_share_of_the_replicas() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=p) for p in (1, 2, 3, 4, 5)]
    records = {
        f"10.0.0.1:{port}": TelemetryRecord(at=100.0, waiting=waiting, kv_cache=kv)
        for port, waiting, kv in ((1, 6, 0.1), (2, 2, 0.9), (3, 0, 0.1), (4, 0, 0.1), (5, 0, 0.3))
    }
    pool = pool_signals(endpoints, records, now=100.0, max_age=10.0, saturation=SATURATION)
    assert [(s.name, s.mean) for s in pool] == [("queue", 1.6), ("kvCache", pytest.approx(0.3))]
    # The busiest 25% of five replicas is two of them, picked per signal.
    quarter = Saturation(busiest=25)
    busiest = pool_signals(endpoints, records, now=100.0, max_age=10.0, saturation=quarter)
    assert [(s.name, s.mean) for s in busiest] == [("queue", 4.0), ("kvCache", 0.6)]
    assert pool_pressure(endpoints, records, now=100.0, max_age=10.0, saturation=quarter) == 1.0
    one = Saturation(busiest=1)  # at least one replica: the busiest
    assert pool_signals(endpoints, records, now=100.0, max_age=10.0, saturation=one)[0].mean == 6


def test_busiest_leaves_the_time_to_first_token_a_pool_mean() -> None:
    # One replica prefills a long prompt (its TTFT is that prompt's own prefill); the pool
    # has room. Over the busiest quarter the TTFT would read 0.8 against a 0.5 bound.
    endpoints = [Endpoint(address="10.0.0.1", port=p) for p in (1, 2, 3, 4)]
    records = {
        f"10.0.0.1:{port}": TelemetryRecord(at=100.0, waiting=0, ttft=ttft)
        for port, ttft in ((1, 0.8), (2, 0.1), (3, 0.1), (4, 0.2))
    }
    quarter = Saturation(busiest=25)
    signals = pool_signals(
        endpoints, records, now=100.0, max_age=10.0, saturation=quarter, ttft_bound=0.5
    )
    assert [(s.name, s.mean) for s in signals][-1] == ("ttft", pytest.approx(0.3))
    assert pressure_of(signals) == 0.6


def test_the_mean_time_to_first_token_saturates_at_half_the_first_class_objective() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=p) for p in (1, 2, 3)]
    records = {
        "10.0.0.1:1": TelemetryRecord(at=100.0, waiting=0, ttft=0.9),
        "10.0.0.1:2": TelemetryRecord(at=100.0, waiting=0, ttft=0.3),
        "10.0.0.1:3": TelemetryRecord(at=100.0, waiting=0),  # idle: no TTFT, not counted
    }
    classes = ServiceClasses.model_validate({"classes": [INTERACTIVE, BATCH]})
    assert classes.ttft_bound == 0.5  # half of interactive's 1 s
    pressure = pool_pressure(
        endpoints,
        records,
        now=101.0,
        max_age=10.0,
        saturation=classes.saturation,
        ttft_bound=classes.ttft_bound,
    )
    assert pressure == pytest.approx(1.2)  # mean 0.6 s over 0.5 s; no queue at all
    explicit = ServiceClasses.model_validate(
        {"classes": [INTERACTIVE, BATCH], "saturation": {"ttft": "1200ms"}}
    )
    assert explicit.ttft_bound == 1.2
    # Without a bound (or without TTFT in the records) the queue and KV cache decide alone.
    assert pool_pressure(
        endpoints, records, now=101.0, max_age=10.0, saturation=classes.saturation
    ) == pytest.approx(0.0)


def test_a_saturated_pool_becomes_shed_and_divert_entries_that_envoy_accepts(
    tmp_path: Path,
) -> None:
    objects = load_objects(EXAMPLE)
    # Mean queue 5 against a bound of 4: pressure 1.25, one step of 25% a round.
    busy = {
        "10.0.6.10:8000": TelemetryRecord(at=0.0, waiting=5),
        "10.0.6.11:8000": TelemetryRecord(at=0.0, waiting=5),
    }
    previous: dict[str, AdmissionDecision] = {}
    for second in range(6):  # 6 steps: all of batch, then half of background
        state = PolicyState.from_objects(
            objects,
            telemetry={
                "llama-8b": {k: v.model_copy(update={"at": second}) for k, v in busy.items()}
            },
            now=float(second),
            previous_admission=previous,
        )
        plan = compile_plan(state)
        previous = dict(plan.admission)
    assert dict(previous["classes/chat"].admitted or {}) == {
        "interactive": 1.0,
        "standard": 1.0,
        "background": 0.5,
        "batch": 0.0,
    }
    resources = translate(plan.fleets[0])
    entries = {r.name: r for r in resources.routes[0].virtual_hosts[0].routes}
    shed = entries["classes/chat#0@batch/shed"]
    assert shed.direct_response.status == SHED_STATUS
    assert shed.match.runtime_fraction.default_value.numerator == 1_000_000
    assert [h.header.value for h in shed.response_headers_to_add] == ["30"]
    assert [h.string_match.safe_regex.regex for h in shed.match.headers][-1] == (
        "^(nightly\\-etl|evals)$"
    )
    queued = entries["classes/chat#0@background/queue"]
    assert queued.route.cluster == "classes/chat/queue/background"
    assert queued.match.runtime_fraction.default_value.numerator == 500_000
    assert queued.stat_prefix == "chat.background.queued"
    held = {c.name: c for c in resources.clusters}["classes/chat/queue/background"]
    assert held.eds_cluster_config.service_name == "classes/chat"  # the route's endpoints
    limits = held.circuit_breakers.thresholds[0]
    assert (limits.max_connections.value, limits.max_pending_requests.value) == (4, 200)
    # Standard is not restricted yet: it is more important than background.
    assert "classes/chat#0@standard/divert" not in entries
    # Interactive requests, the fallback class, are never restricted.
    assert not any(
        name.startswith("classes/chat#0@interactive/") and "shed" in name for name in entries
    )
    # The route's own class is admitted on the route that diverted requests go to.
    assert "classes/spill#0@standard/divert" not in entries
    ok, output = validate_with_envoy(resources, find_binary("envoy"), tmp_path)
    assert ok, output


def test_admission_changes_only_route_configurations() -> None:
    """Shedding moves RDS alone: listeners and clusters are byte for byte what they were, so
    no connection is drained and no cluster rebuilt when a class is restricted."""
    objects = load_objects(EXAMPLE)
    calm = translate(compile_plan(PolicyState.from_objects(objects)).fleets[0])
    busy = PolicyState.from_objects(
        objects,
        telemetry={"llama-8b": {"10.0.6.10:8000": TelemetryRecord(at=0.0, waiting=40)}},
        now=0.0,
    )
    shedding = translate(compile_plan(busy).fleets[0])
    assert shedding.listeners == calm.listeners
    assert shedding.clusters == calm.clusters
    assert shedding.routes != calm.routes
