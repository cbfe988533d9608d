"""The service-class benchmark's arithmetic: per-class goodput, shed counts, time to recover
and the target rows, on hand-made request results (the run itself is `make bench`); and the
policy a batch lane applies."""

from __future__ import annotations

import json
from dataclasses import replace

from bench.classes.config import (
    BATCH,
    BATCH_HEADER,
    INTERACTIVE,
    LANE_POOL,
    POLICIES,
    Phase,
    default_config,
    lane_route,
)
from bench.classes.report import engine_phases, slower_by_phase, summarize, targets
from bench.classes.results import ClassRow, PhaseRow, PolicyRun, SignalLead
from bench.rig.loadgen import RequestResult
from bench.rig.stack import POOL, expected_clusters, policy_body
from policies.models import RoutingPolicy


def _ok(session: str, start: float, ttft: float) -> RequestResult:
    return RequestResult(session, 0, start, status=200, ttft=ttft, latency=ttft + 1)


def _shed(session: str, start: float) -> RequestResult:
    return RequestResult(session, 0, start, status=429, error="HTTP 429")


def test_goodput_counts_requests_within_their_class_objective_and_recovery_the_last_miss() -> None:
    config = default_config()
    config = type(config)(
        phases=(Phase("calm", 10, 0.4, 0.1), Phase("overload", 10, 0.6, 0.7), Phase("r", 10, 0, 0)),
        objectives={INTERACTIVE: 1.0, BATCH: 30.0},
    )
    results = [
        _ok("s7-1", 1.0, 0.2),  # interactive, within 1 s
        _ok("s7-2", 12.0, 3.0),  # interactive, missed
        _ok("s7-3", 24.0, 2.0),  # missed after the overload: recovery 4 s
        _ok("d101-1", 2.0, 20.0),  # batch within 30 s
        _shed("d101-2", 15.0),
        _shed("d101-3", 5.0),  # shed in the calm phase
        RequestResult("d101-4", 0, 16.0, status=503, error="HTTP 503"),
    ]
    summary = summarize(results, config)
    interactive, batch = summary.classes[INTERACTIVE], summary.classes[BATCH]
    assert (interactive.requests, interactive.met_objective) == (3, 1)
    assert (batch.ok, batch.shed, batch.errors, batch.met_objective) == (1, 2, 1, 1)
    assert summary.goodput_per_s == 2 / 30
    assert summary.recovery_s == 4.0
    assert summary.shed_in_calm_phase == 1


def test_the_ramp_counts_in_no_number_but_a_request_shed_in_it_was_shed_with_room() -> None:
    config = type(default_config())(
        phases=(
            Phase("ramp", 10, 0.4, 0.1, measured=False),
            Phase("calm", 10, 0.4, 0.1),
            Phase("overload", 10, 0.6, 0.7),
            Phase("recovery", 10, 0.4, 0.1),
        ),
    )
    results = [
        _ok("s7-1", 5.0, 3.0),  # in the ramp: neither a miss nor a request
        _shed("d101-1", 6.0),  # shed in the ramp: the fleet had room
        _ok("s7-2", 12.0, 0.2),
        _ok("s7-3", 25.0, 2.0),  # missed in the overload
    ]
    summary = summarize(results, config)
    interactive = summary.classes[INTERACTIVE]
    assert (interactive.requests, interactive.met_objective) == (2, 1)
    assert interactive.by_phase["overload"] == PhaseRow(requests=1, shed=0, ttft_p99=2.0)
    assert "ramp" not in interactive.by_phase
    assert summary.classes[BATCH].requests == 0
    assert summary.goodput_per_s == 1 / 30  # over the 30 measured seconds
    assert summary.shed_in_calm_phase == 1
    assert summary.recovery_s == 0.0


def test_engine_counters_tell_a_saturated_phase_from_a_calm_one() -> None:
    config = type(default_config())(
        phases=(Phase("calm", 10, 0.4, 0.1), Phase("overload", 10, 0.6, 0.7)),
    )
    full = config.routing.sim.max_batch
    samples = [
        {"at": 1.0, "running": 3.0, "waiting": 0.0, "kv_cache": 0.2},
        {"at": 2.0, "running": 0.8 * full, "waiting": 0.5, "kv_cache": 0.3},
        {"at": 11.0, "running": float(full), "waiting": 2.0, "kv_cache": 0.5},
        {"at": 12.0, "running": float(full), "waiting": 0.0, "kv_cache": 0.5},
    ]
    phases = engine_phases(samples, config)
    assert phases["calm"]["saturated_share"] == 0.0  # a full batch needs 90% of the slots
    assert phases["overload"]["saturated_share"] == 0.5  # ... and requests waiting
    assert phases["overload"]["waiting"] == 1.0


def test_targets_compare_the_runs_side_by_side() -> None:
    def row(requests: int, ok: int, shed: int, errors: int, p99: float | None) -> ClassRow:
        return ClassRow(requests, ok, shed, 0, errors, [], None, p99, None, 0, 0.0)

    def run(p99: float, goodput: float, errors: int = 0, calm: int = 0) -> PolicyRun:
        return PolicyRun(
            classes={INTERACTIVE: row(10, 10, 0, 0, p99), BATCH: row(12, 10, 2, errors, None)},
            goodput_per_s=goodput,
            recovery_s=0.0,
            shed_in_calm_phase=calm,
        )

    rows = targets({"reference": run(0.2, 5), "affinity": run(2.0, 4.0), "classes": run(0.25, 4.5)})
    assert [met for _, met, _ in rows] == [True, True, True, True, True]
    rows = targets(
        {
            "reference": run(0.2, 5),
            "affinity": run(0.5, 4.0),
            "classes": run(0.4, 3.0, errors=1, calm=2),
        }
    )
    assert [met for _, met, _ in rows] == [False, False, False, False, False]


def test_slow_interactive_requests_are_counted_by_the_phase_they_started_in() -> None:
    config = type(default_config())(
        phases=(
            Phase("ramp", 5, 0.4, 0.1, measured=False),
            Phase("calm", 10, 0.4, 0.1),
            Phase("overload", 10, 0.6, 0.7),
        ),
    )
    results = [
        _ok("s7-1", 1.0, 0.9),  # slow, but in the ramp: not measured
        _ok("s7-2", 6.0, 0.5),  # slow, calm
        _ok("s7-3", 7.0, 0.2),  # within the bound
        _ok("s7-4", 16.0, 0.4),  # slow, overload
        _ok("s7-5", 17.0, 0.6),  # slow, overload
        _ok("d101-1", 18.0, 0.9),  # batch: not counted
    ]
    per_request = summarize(results, config).per_request
    assert slower_by_phase(per_request, 0.3, config) == {"calm": 1, "overload": 2}


def test_a_batch_lane_sends_batch_to_its_own_replicas_and_the_sessions_to_the_others() -> None:
    config = default_config()
    policy = next(p for p in POLICIES if p.key == "classes_lane")
    lane = config.lanes[policy.key]
    body = policy_body(10000, policy.route, before=[lane_route(policy.route)])
    body["spec"]["serviceClasses"] = config.service_classes[policy.key]
    routes = RoutingPolicy.model_validate(body).spec.routes
    assert [(r.name, [t.pool for t in r.tiers[0].pools]) for r in routes] == [
        ("batch", [LANE_POOL]),
        ("chat", [POOL]),
    ]
    # Only batch requests take the lane: the route matches their header.
    assert [(h.name, h.value) for h in routes[0].match.headers] == [BATCH_HEADER]
    assert not routes[1].match.headers
    sizes = {POOL: config.replicas - lane, LANE_POOL: lane}
    clusters = expected_clusters(body, sizes)
    assert clusters["bench/batch"][1] == lane
    assert clusters["bench/chat"][1] == config.replicas - lane
    assert clusters["bench/chat/affinity"] == (("RING_HASH", 150), config.replicas - lane)


def test_a_run_reads_back_from_its_json_as_it_was() -> None:
    config = type(default_config())(
        phases=(Phase("calm", 10, 0.4, 0.1), Phase("overload", 10, 0.6, 0.7)),
    )
    results = [_ok("s7-1", 1.0, 0.2), _ok("s7-2", 12.0, 3.0), _shed("d101-1", 15.0)]
    summary = summarize(results, config)
    written = json.loads(json.dumps(summary.to_json()))
    assert PolicyRun.from_json(written) == summary
    # Every request in the file with its class beside its fields, as before.
    assert [r["class"] for r in written["per_request"]] == ["interactive", "interactive", "batch"]
    lead = SignalLead(peak=3.0, correlation_by_lag={"0": 0.5, "2": None}, best_lag="0")
    with_signals = replace(summary, signals={"waiting": lead})
    written = json.loads(json.dumps(with_signals.to_json()))
    assert written["signals"]["waiting"]["best_lag"] == "0"
    assert PolicyRun.from_json(written) == with_signals
