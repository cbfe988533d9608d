"""The weight function, case by case: each row is one behaviour, read the ids.

Pools have three endpoints a, b, c of static weight 100 unless a case says otherwise; the
default ``WeightParams`` apply (queue_ref 8, step 0.1, band 0.15, degraded at 32 queued or 97%
KV cache; capacity levels 1, 0.7, 0.5, 0.35, 0.25, band 0.8, two records to confirm). ``now``
is 1000.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.models import TELEMETRY_HASH_BALANCE_FACTOR, Endpoint
from signals.telemetry import TelemetryRecord
from signals.weights import WeightDecision, WeightParams, pool_weights

NOW = 1000.0
PORTS = {"a": 8001, "b": 8002, "c": 8003}


def key(name: str) -> str:
    return f"10.0.0.1:{PORTS[name]}"


@dataclass
class Case:
    id: str
    telemetry: dict[str, dict[str, Any]]
    weights: dict[str, int]
    degraded: set[str] = field(default_factory=set)
    static: dict[str, int] = field(default_factory=dict)
    previous: dict[str, WeightDecision] = field(default_factory=dict)
    affinity: bool = False
    health: dict[str, str] = field(default_factory=dict)


def fresh(**signals: float) -> dict[str, Any]:
    return {"at": NOW - 1, **signals}


def prev(factor: float, degraded: bool = False) -> WeightDecision:
    return WeightDecision(weight=round(100 * factor), factor=factor, degraded=degraded, load=0.0)


CASES = [
    Case("no telemetry: static weights", {}, {"a": 100, "b": 100, "c": 100}),
    Case(
        "all idle: static weights",
        {n: fresh(waiting=0, running=0, kv_cache=0) for n in "abc"},
        {"a": 100, "b": 100, "c": 100},
    ),
    Case(
        "one long queue drops that replica to the floor",
        {"a": fresh(waiting=40), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 10, "b": 100, "c": 100},
        degraded={"a"},  # 40 queued is over the saturation bound of 32
    ),
    Case(
        "a moderate queue lowers the weight in steps of 0.1 (load 0.5 -> factor 0.55 -> 0.6)",
        {"a": fresh(waiting=4), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 60, "b": 100, "c": 100},
    ),
    Case(
        "equal load everywhere: weights are relative, nothing moves",
        {n: fresh(waiting=20, running=10, kv_cache=0.5) for n in "abc"},
        {"a": 100, "b": 100, "c": 100},
    ),
    Case(
        "stale telemetry (older than max_age 10s) is neutral, not zero",
        {"a": {"at": NOW - 11, "waiting": 40}, "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 100, "b": 100, "c": 100},
    ),
    Case(
        "noise inside the hysteresis band changes nothing (1 queued: factor 0.89, band 0.15)",
        {"a": fresh(waiting=1), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 100, "b": 100, "c": 100},
    ),
    Case(
        "hysteresis holds a lowered factor while the target stays within the band",
        {"a": fresh(waiting=3), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 60, "b": 100, "c": 100},
        previous={"a": prev(0.6)},
    ),
    Case(
        "leaving the band moves the factor to the nearest step",
        {"a": fresh(waiting=0), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 100, "b": 100, "c": 100},
        previous={"a": prev(0.6)},
    ),
    Case(
        "affinity pools ignore load: 40 queued moves nothing and degrades nothing",
        {"a": fresh(waiting=40), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 100, "b": 100, "c": 100},
        affinity=True,
    ),
    Case(
        "without affinity, 2 queued gives 0.8",
        {"a": fresh(waiting=2), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 80, "b": 100, "c": 100},
    ),
    Case(
        "capacity-aware: double capacity with double queue is as loaded as its peer",
        {"a": fresh(waiting=8), "b": fresh(waiting=4), "c": fresh(waiting=0)},
        {"a": 80, "b": 40, "c": 100},
        static={"a": 200},
    ),
    Case(
        "a full batch (running = max_running) counts half: factor 0.6",
        {"a": fresh(running=32, max_running=32), "b": fresh(running=0), "c": fresh(running=0)},
        {"a": 60, "b": 100, "c": 100},
    ),
    Case(
        "KV cache at 80% counts half of it: factor 0.64 -> 0.6",
        {"a": fresh(kv_cache=0.8), "b": fresh(kv_cache=0.0), "c": fresh(kv_cache=0.0)},
        {"a": 60, "b": 100, "c": 100},
    ),
    Case(
        "KV cache near full marks the replica degraded",
        {"a": fresh(kv_cache=0.98), "b": fresh(kv_cache=0.1), "c": fresh(kv_cache=0.1)},
        {"a": 60, "b": 100, "c": 100},
        degraded={"a"},
    ),
    Case(
        "all queues long: at most half the pool is degraded, the most loaded first; weights "
        "stay relative to the least loaded",
        {"a": fresh(waiting=40), "b": fresh(waiting=50), "c": fresh(waiting=45)},
        {"a": 100, "b": 40, "c": 70},
        degraded={"b"},
    ),
    Case(
        "a degraded replica stays degraded until its queue is under half the bound",
        {"a": fresh(waiting=20), "b": fresh(waiting=20), "c": fresh(waiting=0)},
        {"a": 10, "b": 10, "c": 100},
        degraded={"a"},
        previous={"a": prev(0.1, degraded=True), "b": prev(0.1)},
    ),
    Case(
        "and recovers below it",
        {"a": fresh(waiting=10), "b": fresh(waiting=10), "c": fresh(waiting=0)},
        {"a": 10, "b": 10, "c": 100},
        previous={"a": prev(0.1, degraded=True), "b": prev(0.1)},
    ),
    Case(
        "static health wins: a draining endpoint is not marked degraded",
        {"a": fresh(waiting=40), "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 10, "b": 100, "c": 100},
        health={"a": "draining"},
    ),
    Case(
        "a timestamp from the future (clock skew) counts as fresh",
        {"a": {"at": NOW + 5, "waiting": 4}, "b": fresh(waiting=0), "c": fresh(waiting=0)},
        {"a": 60, "b": 100, "c": 100},
    ),
    Case(
        "an endpoint with telemetry and one without: the unknown one keeps its static weight",
        {"a": fresh(waiting=4)},
        {"a": 100, "b": 100, "c": 100},  # a is alone in the fresh set, so it is the least loaded
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_pool_weights(case: Case) -> None:
    endpoints = [
        Endpoint(
            address="10.0.0.1",
            port=PORTS[name],
            weight=case.static.get(name, 100),
            health=case.health.get(name, "healthy"),  # type: ignore[arg-type]
        )
        for name in "abc"
    ]
    telemetry = {key(n): TelemetryRecord.model_validate(r) for n, r in case.telemetry.items()}
    previous = {key(n): d for n, d in case.previous.items()}
    decisions = pool_weights(
        endpoints, telemetry, now=NOW, previous=previous, affinity=case.affinity
    )
    assert {n: decisions[key(n)].weight for n in "abc"} == case.weights
    assert {n for n in "abc" if decisions[key(n)].degraded} == case.degraded


def test_stale_and_missing_decisions_say_so() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=PORTS[n]) for n in "abc"]
    telemetry = {
        key("a"): TelemetryRecord(at=NOW - 60, waiting=3),
        key("b"): TelemetryRecord(at=NOW - 2, waiting=3),
    }
    decisions = pool_weights(endpoints, telemetry, now=NOW)
    assert decisions[key("a")].neutral and decisions[key("a")].age == 60
    assert not decisions[key("b")].neutral and decisions[key("b")].age == 2
    assert decisions[key("c")].neutral and decisions[key("c")].age is None


def test_a_single_replica_pool_is_never_degraded() -> None:
    endpoint = Endpoint(address="10.0.0.1", port=8001)
    decisions = pool_weights(
        [endpoint], {endpoint.key: TelemetryRecord(at=NOW, waiting=500)}, now=NOW
    )
    assert decisions[endpoint.key] == WeightDecision(
        weight=100, factor=1.0, degraded=False, load=1.0, age=0.0
    )


def test_max_age_comes_from_params() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=PORTS[n]) for n in "ab"]
    telemetry = {key("a"): TelemetryRecord(at=NOW - 3, waiting=8)}
    telemetry[key("b")] = TelemetryRecord(at=NOW - 3, waiting=0)
    assert pool_weights(endpoints, telemetry, now=NOW)[key("a")].weight == 10
    short = WeightParams(max_age=2)
    assert pool_weights(endpoints, telemetry, now=NOW, params=short)[key("a")].weight == 100


signals = st.fixed_dictionaries(
    {},
    optional={
        "waiting": st.floats(0, 1000),
        "running": st.floats(0, 1000),
        "max_running": st.floats(1, 1000),
        "kv_cache": st.floats(0, 1.5),
        "pending_tokens": st.floats(0, 1e6),
    },
)


@given(
    st.lists(st.tuples(st.integers(1, 10_000), signals, st.floats(0, 30)), min_size=1, max_size=8)
)
def test_weights_stay_between_the_floor_and_the_static_weight(
    rows: list[tuple[int, dict[str, float], float]],
) -> None:
    endpoints = [
        Endpoint(address="10.0.0.1", port=9000 + i, weight=w) for i, (w, _, _) in enumerate(rows)
    ]
    telemetry = {
        e.key: TelemetryRecord.model_validate({"at": NOW - age, **s})
        for e, (_, s, age) in zip(endpoints, rows, strict=True)
    }
    decisions = pool_weights(endpoints, telemetry, now=NOW)
    for endpoint in endpoints:
        decision = decisions[endpoint.key]
        assert max(1, round(endpoint.weight * 0.1)) <= decision.weight <= endpoint.weight
        if telemetry[endpoint.key].at < NOW - 10:
            assert decision.weight == endpoint.weight and decision.neutral
    assert sum(d.degraded for d in decisions.values()) <= len(endpoints) // 2


def _state(now: float, waiting: dict[int, float], *, affinity: bool = False) -> Any:
    from compiler.compile import PolicyState
    from policies.models import Pool, RoutingPolicy

    pool = Pool.model_validate(
        {
            "metadata": {"name": "p"},
            "spec": {"endpoints": [{"address": "10.0.0.1", "port": p} for p in PORTS.values()]},
        }
    )
    routes: list[dict[str, Any]] = [
        {"name": "static", "balancing": "least_request", "tiers": [["p"]]},
        {"name": "live", "balancing": "telemetry", "tiers": [["p"]], "match": {"pathPrefix": "/x"}},
    ]
    if affinity:
        routes[1]["sessionAffinity"] = {}
    policy = RoutingPolicy.model_validate({"metadata": {"name": "r"}, "spec": {"routes": routes}})
    telemetry = {
        f"10.0.0.1:{port}": TelemetryRecord(at=now, waiting=value)
        for port, value in waiting.items()
    }
    return PolicyState(
        pools={"p": pool}, policies={"r": policy}, telemetry={"p": telemetry}, now=now
    )


def _cluster_weights(plan: Any, name: str) -> dict[int, tuple[int, str]]:
    cluster = next(c for c in plan.fleets[0].clusters if c.name == name)
    return {e.port: (e.weight, e.health) for e in cluster.endpoints}


def test_compile_applies_telemetry_weights_only_to_telemetry_routes() -> None:
    from compiler.compile import compile_plan

    plan = compile_plan(_state(NOW, {8001: 40, 8002: 0, 8003: 0}))
    assert _cluster_weights(plan, "r/static") == dict.fromkeys(PORTS.values(), (100, "healthy"))
    assert _cluster_weights(plan, "r/live") == {
        8001: (10, "degraded"),
        8002: (100, "healthy"),
        8003: (100, "healthy"),
    }
    assert plan.weights["p"]["10.0.0.1:8001"].factor == 0.1


def test_compile_carries_hysteresis_through_previous_weights() -> None:
    from dataclasses import replace

    from compiler.compile import compile_plan

    first = compile_plan(_state(NOW, {8001: 4, 8002: 0, 8003: 0}))
    assert _cluster_weights(first, "r/live")[8001] == (60, "healthy")
    # 3 queued alone would give 0.7; within the band of 0.6 it stays put.
    second = compile_plan(
        replace(_state(NOW, {8001: 3, 8002: 0, 8003: 0}), previous_weights=first.weights)
    )
    assert _cluster_weights(second, "r/live")[8001] == (60, "healthy")
    fresh_start = compile_plan(_state(NOW, {8001: 3, 8002: 0, 8003: 0}))
    assert _cluster_weights(fresh_start, "r/live")[8001] == (70, "healthy")


def test_compile_gives_capacity_weights_when_the_telemetry_route_has_affinity() -> None:
    from compiler.compile import compile_plan

    plan = compile_plan(_state(NOW, {8001: 40, 8002: 0, 8003: 0}, affinity=True))
    assert _cluster_weights(plan, "r/live")[8001] == (100, "healthy")


# --------------------------------------------------------------------------- capacity weights

CAPACITY_ENDPOINTS = [Endpoint(address="10.0.0.1", port=9000 + i) for i in range(4)]
"""Four replicas; the first is the one whose speed changes."""


def _rounds(
    tpots: list[float],
    others: float = 0.03,
    medians: list[float | None] | None = None,
    others_median: float | None = None,
    prefills: list[float | None] | None = None,
    others_prefill: float | None = None,
    running: float | None = None,
    others_running: float | None = None,
    endpoints: list[Endpoint] | None = None,
) -> list[int]:
    """Feed one record per round (replica 0's TPOT, the others at `others`; with `medians`,
    replica 0's median TPOT, the others' at `others_median`; with `prefills`, replica 0's
    prompt tokens prefilled per output token, the others' at `others_prefill`; with
    `running`, replica 0's running sequences, the others' at `others_running`); replica 0's
    weight after each round."""
    endpoints = endpoints or CAPACITY_ENDPOINTS
    previous: dict[str, WeightDecision] = {}
    weights = []
    for index, tpot in enumerate(tpots):
        at = NOW + index
        telemetry = {
            e.key: TelemetryRecord(
                at=at,
                time_per_output_token=tpot if i == 0 else others,
                median_time_per_output_token=(
                    None if medians is None else medians[index] if i == 0 else others_median
                ),
                prefill_per_token=(
                    None if prefills is None else prefills[index] if i == 0 else others_prefill
                ),
                running=running if i == 0 else others_running,
            )
            for i, e in enumerate(endpoints)
        }
        previous = pool_weights(endpoints, telemetry, now=at, previous=previous, affinity=True)
        weights.append(previous[endpoints[0].key].weight)
    return weights


@pytest.mark.parametrize(
    ("tpots", "weights"),
    [
        pytest.param([0.03] * 5, [100] * 5, id="equal speeds: static weights"),
        pytest.param(
            [0.036, 0.02, 0.036, 0.02, 0.036], [100] * 5, id="noise within the band moves nothing"
        ),
        pytest.param([0.09, 0.03, 0.09, 0.03], [100] * 4, id="one slow record is not evidence"),
        pytest.param(
            [0.09, 0.09, 0.09],
            [100, 35, 35],
            id="3x slower twice in a row: straight to the nearest level, one ring change",
        ),
        pytest.param(
            [0.05, 0.09, 0.09],
            [100, 35, 35],
            id="the last record picks the level: the first may hold time before a slowdown",
        ),
        pytest.param([0.06, 0.06, 0.06], [100, 50, 50], id="half speed: half the weight"),
        pytest.param(
            [0.043] * 4, [100] * 4, id="a third slower (busier steps, not a slower GPU): no move"
        ),
        pytest.param(
            [0.06, 0.06, *[0.05] * 4],
            [100, 50, 50, 50, 50, 50],
            id="a half-speed replica that looks faster when lightly loaded stays at half",
        ),
        pytest.param(
            [0.09, 0.09, *[0.03] * 8],
            [100, 35, 35, 50, 50, 70, 70, 100, 100, 100],
            id="recovered: back up one level per two records, no jump",
        ),
    ],
)
def test_capacity_weights_follow_speed(tpots: list[float], weights: list[int]) -> None:
    assert _rounds(tpots) == weights


def test_a_replica_busy_with_long_prompts_is_not_slow() -> None:
    """Its long prefill steps triple the mean TPOT, but most of its tokens come at the usual
    pace: the median (0.0177 s, like the others') says it is busy, not slow."""
    assert _rounds([0.09] * 4, medians=[0.0177] * 4, others_median=0.0177) == [100] * 4


def test_a_replica_that_prefills_what_the_pool_does_not_is_busy_not_slow() -> None:
    """A burst of new documents on one replica of a pool of equal replicas: its steps carry
    their prompts, so even its median TPOT reads it at a third of the others' speed. It
    prefilled 12 prompt tokens per output token where the others prefilled 0.6: busy, not
    slow, and its share of the ring stays (a cut would move sessions away from their
    caches)."""
    burst: list[float | None] = [12.0] * 4
    assert (
        _rounds(
            [0.09] * 4,
            medians=[0.0375] * 4,
            others_median=0.0177,
            prefills=burst,
            others_prefill=0.6,
        )
        == [100] * 4
    )
    # A slow replica prefills what the others do: it falls as before, and a burst among its
    # records is no evidence either way (it does not break the run).
    assert _rounds(
        [0.09] * 3,
        medians=[0.0375] * 3,
        others_median=0.0177,
        prefills=[0.7, 12.0, 0.5],
        others_prefill=0.6,
    ) == [100, 100, 35]
    # Where every prompt is cached, a question's few tokens are not a burst.
    assert _rounds([0.09] * 3, prefills=[0.3] * 3, others_prefill=0.05) == [100, 35, 35]


def test_a_replica_busier_than_its_share_is_not_slow() -> None:
    """The replica holding the popular prefixes decodes four times the others' sequences,
    and its longer steps double its TPOT: it makes twice the others' tokens a second, so it
    is busy, not slow, and its share of the ring stays."""
    assert _rounds([0.06] * 4, running=40, others_running=10) == [100] * 4
    # Its medians agree with its mean: still no evidence of a fall.
    busy = _rounds(
        [0.06] * 4, medians=[0.0375] * 4, others_median=0.0177, running=40, others_running=10
    )
    assert busy == [100] * 4
    # A busier record does not break a run of slow ones either.
    assert _rounds([0.06] * 3, running=10, others_running=10)[-1] == 50


def test_a_slow_replica_given_its_share_of_the_work_still_falls() -> None:
    """Half speed with the pool's share of the sessions: it holds twice the sequences (it
    keeps each twice as long) and makes the pool's tokens a second. Slow, not busier."""
    assert _rounds([0.06] * 3, running=20, others_running=10) == [100, 50, 50]
    # Fewer slots than the others (fewer sequences at a slower pace): slow as well.
    assert _rounds([0.06] * 3, running=5, others_running=10) == [100, 50, 50]
    # Twice the static weight: twice the sessions is its share, not more than it.
    heavy = [
        Endpoint(address="10.0.0.1", port=9000, weight=200),
        *CAPACITY_ENDPOINTS[1:],
    ]
    assert _rounds([0.06] * 3, running=40, others_running=10, endpoints=heavy) == [200, 100, 100]


def test_the_median_says_whether_the_mean_says_how_much() -> None:
    """A 3x slower replica's median lands one coarse bucket up (about 2x): slow enough to
    count, and the mean picks the level."""
    assert _rounds([0.09] * 3, medians=[0.0375] * 3, others_median=0.0177) == [100, 35, 35]


def test_a_record_without_a_median_is_no_evidence_where_the_pool_has_them() -> None:
    assert _rounds([0.09] * 4, medians=[None] * 4, others_median=0.0177) == [100] * 4
    # Nor does it break a run of slow records: a slowed replica decoding one sequence has
    # intervals with too few tokens for a median.
    slow = [0.0375, None, 0.0375]
    assert _rounds([0.09] * 3, medians=slow, others_median=0.0177) == [100, 100, 35]


def test_a_half_speed_replica_that_only_looks_fast_does_not_rise() -> None:
    """The others' long prefill steps inflate their mean TPOT, and the pool's reference with
    it: the half-speed replica's mean speed reads 0.75, above the 0.63 a rise to 0.7 needs.
    Its median (one coarse bucket up, 0.47 of the others') says it is still at half."""
    tpots = [0.06, 0.06, *[0.04] * 4]
    medians: list[float | None] = [0.0375] * 6
    assert _rounds(tpots, medians=medians, others_median=0.0177) == [100, 50, 50, 50, 50, 50]
    # Without medians in the pool the mean decides alone, as before.
    assert _rounds(tpots) == [100, 50, 50, 70, 70, 70]


def test_a_recovered_replica_rises_when_its_median_agrees() -> None:
    tpots = [0.09, 0.09, *[0.03] * 8]
    medians: list[float | None] = [0.0375, 0.0375, *[0.0177] * 8]
    assert _rounds(tpots, medians=medians, others_median=0.0177) == [
        *[100, 35, 35, 50, 50, 70, 70, 100, 100, 100]
    ]
    # A record without a median neither counts towards the rise nor breaks the run.
    tpots = [0.06, 0.06, 0.03, 0.03, 0.03]
    medians = [0.0375, 0.0375, 0.0177, None, 0.0177]
    assert _rounds(tpots, medians=medians, others_median=0.0177) == [100, 50, 50, 50, 70]


def _pool_rounds(rounds: list[list[float | None]]) -> list[int]:
    """One record per endpoint and round, with the TPOTs given (``None``: an idle replica's
    record, no tokens); replica 0's weight after each round."""
    previous: dict[str, WeightDecision] = {}
    weights = []
    for index, tpots in enumerate(rounds):
        at = NOW + index
        telemetry = {
            e.key: TelemetryRecord(at=at, time_per_output_token=tpot)
            for e, tpot in zip(CAPACITY_ENDPOINTS, tpots, strict=True)
        }
        previous = pool_weights(
            CAPACITY_ENDPOINTS, telemetry, now=at, previous=previous, affinity=True
        )
        weights.append(previous[CAPACITY_ENDPOINTS[0].key].weight)
    return weights


def test_the_slow_replicas_left_decoding_as_the_pool_drains_are_not_its_norm() -> None:
    """The half-speed replicas finish their work last: when only they still decode, the
    median of their TPOTs is theirs, and they would read full speed. Half the pool or
    fewer gives no reference, and the learned half stays."""
    busy: list[float | None] = [0.06, 0.03, 0.03, 0.03]
    draining: list[float | None] = [0.06, 0.06, None, None]
    assert _pool_rounds([busy, busy, *[draining] * 4]) == [100, 50, 50, 50, 50, 50]
    # Three of four is a majority: the reference is the pool's again.
    three: list[float | None] = [0.03, 0.03, 0.03, None]
    assert _pool_rounds([busy, busy, three, three, three]) == [100, 50, 50, 70, 70]


def test_a_record_counts_once_however_often_the_pool_is_recompiled() -> None:
    slow = {
        e.key: TelemetryRecord(at=NOW, time_per_output_token=0.09 if i == 0 else 0.03)
        for i, e in enumerate(CAPACITY_ENDPOINTS)
    }
    decisions: dict[str, WeightDecision] = {}
    for _ in range(5):
        decisions = pool_weights(
            CAPACITY_ENDPOINTS, slow, now=NOW, previous=decisions, affinity=True
        )
    assert decisions[CAPACITY_ENDPOINTS[0].key].weight == 100
    assert decisions[CAPACITY_ENDPOINTS[0].key].streak == -1


def test_records_without_tpot_keep_the_learned_capacity() -> None:
    assert _rounds([0.09, 0.09])[-1] == 35
    idle = {e.key: TelemetryRecord(at=NOW + 5) for e in CAPACITY_ENDPOINTS}
    slow = {
        e.key: WeightDecision(weight=35, factor=0.35, load=0.0, seen_at=NOW + 1)
        if i == 0
        else WeightDecision(weight=100, factor=1.0, load=0.0)
        for i, e in enumerate(CAPACITY_ENDPOINTS)
    }
    decisions = pool_weights(CAPACITY_ENDPOINTS, idle, now=NOW + 5, previous=slow, affinity=True)
    assert decisions[CAPACITY_ENDPOINTS[0].key].weight == 35


# --------------------------------------------------------------------------- spill, not evict


def _affinity_factor(plan: Any, name: str) -> int:
    cluster = next(c for c in plan.fleets[0].clusters if c.name == name)
    assert cluster.affinity is not None
    return int(cluster.affinity.hash_balance_factor)


def test_a_telemetry_route_spills_at_125_unless_told_otherwise() -> None:
    from compiler.compile import compile_plan
    from policies.models import Route

    plan = compile_plan(_state(NOW, {8001: 0, 8002: 0, 8003: 0}, affinity=True))
    assert _affinity_factor(plan, "r/live") == TELEMETRY_HASH_BALANCE_FACTOR == 125

    def factor(**route: Any) -> int:
        body = {"name": "r", "tiers": [["p"]], **route}
        affinity = Route.model_validate(body).session_affinity
        assert affinity is not None
        return affinity.hash_balance_factor

    assert factor(balancing="telemetry", sessionAffinity={"header": "x-s"}) == 125
    assert factor(balancing="telemetry", sessionAffinity={"hashBalanceFactor": 150}) == 150
    assert factor(balancing="telemetry", sessionAffinity={"hashBalanceFactor": 0}) == 0
    assert factor(balancing="least_request", sessionAffinity={}) == 150
    assert factor(sessionAffinity={}) == 150
