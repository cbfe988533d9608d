"""Overflow by arrivals in one unit of work (``signals.overflowff``: output tokens plus the
uncached prompt tokens at ``PREFILL_WEIGHT``): the work of a response, the book that reads
it from the usage log (``xdsserver.work``), the capacity measured replica by replica in
work, the demand at the mix of kinds, and the share that follows."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from harness.builders import arrivals_overflow

from compiler.compile import PolicyState, compile_plan
from controlplane.decode import DecodedState
from policies import parse_object
from policies.models import Pool, RoutingPolicy
from policies.models.overflow import UTILIZATION
from signals.overflow import OverflowDecision
from signals.overflowff import PRIOR_SHARE, ArrivalsDecision, decide_arrivals
from signals.overflowwork import (
    FULL_SCRAPES,
    MIN_WORK_REQUESTS,
    PREFILL_WEIGHT,
    RATE_WEIGHT,
    SAMPLE_WINDOW,
    KindWork,
    ReplicaLoad,
    Work,
    computed_rate,
    engine_work,
    full_scrapes,
    rate_sample,
    settled,
    work_sample,
)
from signals.spill import LOAD
from signals.telemetry import TelemetryRecord
from xdsserver.arrivals import ARRIVAL_WINDOW
from xdsserver.translate.usage import USAGE_FILTER
from xdsserver.work import WorkBook, entry_kind

NOW = 10_000.0

# --------------------------------------------------------------------------- the unit


def test_the_work_of_a_response_is_its_output_and_a_tenth_of_what_it_prefilled() -> None:
    assert PREFILL_WEIGHT == 0.1
    # 1,200 prompt tokens of which 1,000 were cached: 200 prefilled, 150 decoded.
    assert Work.of(1200, 1000, 150).at(PREFILL_WEIGHT) == pytest.approx(150 + 20)
    assert Work.of(100, 0, 0).at(PREFILL_WEIGHT) == pytest.approx(10)
    # A cached count above the prompt's (a provider's rounding) prefills nothing.
    assert Work.of(100, 128, 50).at(PREFILL_WEIGHT) == 50


def test_the_mean_of_a_mix_is_the_kinds_rates_times_their_own_means() -> None:
    # 4 plain requests of 100 and 6 conversation turns of 300: the demand's work at 5/s is
    # 2/s x 100 + 3/s x 300 = 1,100, that is 5/s x 220.
    kinds = KindWork(plain=4, plain_output=400.0, sessions=6, session_output=1800.0)
    assert kinds.mean() == pytest.approx(220.0)
    assert kinds.plain_work_share() == pytest.approx(400 / 2200)
    # Too few responses: no mean (the unit stays requests).
    few = KindWork(plain=MIN_WORK_REQUESTS - 1, plain_output=700.0)
    assert few.mean() is None
    assert KindWork().plain_work_share() is None


# --------------------------------------------------------------------------- the book


def _usage(
    route_name: str,
    *,
    prompt: int,
    cached: int,
    completion: int,
    port: int = 8001,
    status: int = 200,
    usage: bool = True,
) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.route_name = route_name
    common.upstream_remote_address.socket_address.address = "10.0.1.1"
    common.upstream_remote_address.socket_address.port_value = port
    if usage:
        fields = common.metadata.filter_metadata[USAGE_FILTER].fields
        fields["prompt"].number_value = prompt
        fields["cached"].number_value = cached
        fields["completion"].number_value = completion
    entry.response.response_code.value = status
    return entry


def test_the_kind_of_a_request_is_the_route_entry_that_took_it() -> None:
    assert entry_kind("main/chat#0") == ("main/chat", False)
    assert entry_kind("main/chat#0/prefix") == ("main/chat", False)
    assert entry_kind("main/chat#0/overflow") == ("main/chat", False)
    assert entry_kind("main/chat#0/affinity") == ("main/chat", True)
    assert entry_kind("main/chat#1@gold/affinity/overflow") == ("main/chat", True)


def test_the_book_counts_work_per_host_and_per_route_and_kind() -> None:
    clock = [1000.0]
    book = WorkBook(lambda: clock[0])
    for _ in range(10):  # over 5 s: a plain request on 8001, a conversation turn on 8002
        book.observe(_usage("main/chat#0", prompt=1080, cached=1000, completion=150))
        book.observe(
            _usage("main/chat#0/affinity", prompt=3100, cached=3000, completion=250, port=8002)
        )
        clock[0] += 0.5
    # The plain ones' paid twins (served by a provider's host), a 503 and one without usage.
    for _ in range(2):
        book.observe(
            _usage("main/chat#0/overflow", prompt=1080, cached=0, completion=150, port=443)
        )
    book.observe(_usage("main/chat#0", prompt=100, cached=0, completion=10, status=503))
    book.observe(_usage("main/chat#0", prompt=100, cached=0, completion=10, usage=False))
    # (output, prefilled) tokens of each.
    plain, turn, paid = Work(150, 80), Work(250, 100), Work(150, 1080)
    assert book.entries == 22
    assert book.host_work() == {
        "10.0.1.1:8001": Work(10 * 150 / 5.0, 10 * 80 / 5.0),
        "10.0.1.1:8002": Work(10 * 250 / 5.0, 10 * 100 / 5.0),
    }  # (the provider's host was first seen just now: no rate yet)
    # Over the last 2 s alone: the three that ended 0.5, 1 and 1.5 s ago.
    recent = book.host_work(window=2.0)
    assert recent["10.0.1.1:8001"] == Work(3 * 150 / 2.0, 3 * 80 / 2.0)
    # Work at the constant weight: 150 + 8 for a plain request.
    assert recent["10.0.1.1:8001"].at(PREFILL_WEIGHT) == pytest.approx(3 * 158 / 2.0)
    # Prefill per completion token: 80 / 150 for the plain requests' replica.
    per_token = book.prefill_per_output()
    assert per_token["10.0.1.1:8001"] == pytest.approx(80 / 150, abs=1e-4)
    assert per_token["10.0.1.1:443"] == pytest.approx(1080 / 150, abs=1e-4)
    kinds = book.kinds()["main/chat"]
    assert (kinds.plain, kinds.sessions) == (12, 10)
    assert (kinds.plain_output, kinds.plain_prefill) == (12 * 150, 10 * 80 + 2 * 1080)
    assert (kinds.session_output, kinds.session_prefill) == (10 * 250, 10 * 100)
    assert kinds.plain_work() == pytest.approx(10 * plain.at(0.1) + 2 * paid.at(0.1))
    assert kinds.session_work(0.25) == pytest.approx(10 * turn.at(0.25))
    # All of it leaves the window.
    clock[0] += ARRIVAL_WINDOW
    assert book.host_work() == {} and book.kinds() == {} and book.prefill_per_output() == {}


def test_the_book_stays_bounded_when_nothing_reads_it() -> None:
    # A fleet without overflow by arrivals: the reconciler never reads the windows, and
    # they still hold no more than the window's entries (an entry every 0.5 s for 60 s).
    clock = [1000.0]
    book = WorkBook(lambda: clock[0])
    for _ in range(120):
        book.observe(_usage("main/chat#0", prompt=1080, cached=1000, completion=150))
        clock[0] += 0.5
    assert book.entries == 120
    per_window = int(ARRIVAL_WINDOW / 0.5)
    assert per_window <= book.held <= 2 * per_window  # the host's and the route's


def test_only_a_route_that_overflows_by_arrivals_reads_the_work_windows() -> None:
    owned, paid, main = arrivals_overflow(PORTS)
    objects = {"pools/owned": Pool.model_validate(owned), "pools/paid": Pool.model_validate(paid)}
    assert not DecodedState(objects=dict(objects)).overflows_by_arrivals()
    by_fill = json.loads(json.dumps(main))
    by_fill["spec"]["routes"][0]["overflow"]["signal"] = "fill"
    objects["policies/main"] = RoutingPolicy.model_validate(by_fill)
    assert not DecodedState(objects=dict(objects)).overflows_by_arrivals()
    objects["policies/main"] = RoutingPolicy.model_validate(main)
    assert DecodedState(objects=dict(objects)).overflows_by_arrivals()


# --------------------------------------------------------------------------- the capacity


def _replicas(running: float, work: float | None, count: int = 4) -> list[ReplicaLoad]:
    return [ReplicaLoad(key=f"r{i}", slots=8, running=running, work=work) for i in range(count)]


def test_a_replica_counts_once_it_has_been_full_for_a_request_and_a_window() -> None:
    replicas = [*_replicas(1.0, 1000.0, 1), ReplicaLoad("r1", 8, 1.0, 600.0)]
    # A request's time in the batch (at least a window), then the window.
    assert settled(8.0) == 8.0 + SAMPLE_WINDOW
    assert settled(4.0) == settled(None) == 2 * SAMPLE_WINDOW
    wait = settled(4.0)
    since = {"r0": NOW - wait, "r1": NOW - wait + 1}
    # r1 filled a second too late: r0's work over its slots alone.
    assert work_sample(replicas, since, NOW, 4.0) == pytest.approx(1000 / 8)
    assert work_sample(replicas, {**since, "r1": NOW - wait}, NOW, 4.0) == pytest.approx(1600 / 16)
    assert work_sample(replicas, {}, NOW, 4.0) is None


def test_an_engine_computes_its_output_tokens_times_its_responses_work_per_token() -> None:
    # 320 output tokens a second; its responses needed 1.2 work per output token (2 prompt
    # tokens prefilled per token made, at a tenth).
    assert computed_rate(320.0, 1.2) == pytest.approx(320 * 1.2)
    # Without an output rate, or no response to say what a token costs: no rate.
    assert computed_rate(320.0, None) is None
    assert computed_rate(None, 1.2) is None
    # No token made between two scrapes (a long prefill's step): a rate of nothing.
    assert computed_rate(0.0, 1.2) == 0.0


def test_the_rate_sample_takes_the_replicas_full_at_their_last_scrape() -> None:
    replicas = [
        ReplicaLoad("r0", 8, 1.0, None, rate=400.0),
        ReplicaLoad("r1", 8, 1.0, None, rate=320.0),
        ReplicaLoad("r2", 8, 0.5, None, rate=100.0),  # not full: its rate is no capacity
        ReplicaLoad("r3", 8, 1.0, 500.0),  # full, no token timings
    ]
    assert rate_sample(replicas) == pytest.approx(720 / 16)
    # A full replica that made no token since its last scrape counts, at nothing.
    prefilling = ReplicaLoad("r4", 8, 1.0, None, rate=0.0)
    assert rate_sample([*replicas, prefilling]) == pytest.approx(720 / 24)
    assert rate_sample(replicas[2:]) is None


CONVERSATIONS = KindWork(plain=40, plain_output=40 * 160.0, sessions=60, session_output=60 * 400.0)
"""The mixed demand: 40% plain requests of 160 work, 60% conversation turns of 400: 304 a
request, 21% of the work without a session."""


def _work_round(
    previous: ArrivalsDecision | None,
    demand: float,
    *,
    now: float,
    running: float,
    work: float | None,
    kinds: KindWork | None = CONVERSATIONS,
    completed_work: float | None = None,
) -> ArrivalsDecision:
    return decide_arrivals(
        previous,
        demand=demand,
        slots=32,
        running=running,
        fill=running,
        completions=None,
        service_time=4.0,  # prior 0.7 x 32 / 4 = 5.6/s
        now=now,
        replicas=_replicas(running, work),
        kinds=kinds,
        completed_work=completed_work,
    )


def test_capacity_in_work_does_not_depend_on_the_kind_the_replicas_served() -> None:
    # The owned replicas are full and serve conversation turns alone (the plain requests
    # went to paid): 3 turns of 400 a second each, 1,200 work/s per replica, 4,800 in all.
    # In requests that read 12/s of turns, against a demand whose request is 304 on
    # average: 4,800 / 304 = 15.8 requests a second of the mix.
    decision = _work_round(None, 20.0, now=NOW, running=1.0, work=1200.0)
    assert not decision.measured and decision.capacity == pytest.approx(PRIOR_SHARE * 8.0)
    assert decision.work == pytest.approx(304.0)
    decision = _work_round(decision, 20.0, now=NOW + settled(4.0), running=1.0, work=1200.0)
    assert decision.measured and decision.work_per_slot == pytest.approx(150.0)
    assert decision.capacity == pytest.approx(4800 / 304, rel=1e-3)
    # The share is of the demand's work: 20/s x 304 against 0.97 x 4,800.
    paid = 1 - LOAD * 4800 / (20 * 304)
    assert decision.paid == pytest.approx(paid, abs=1e-3)
    # Requests without a session carry 21% of the work: they go first, as many as that is.
    assert decision.plain_share == pytest.approx(6400 / 30400, abs=1e-4)
    assert "in work, 304 a request, 4800/s" in decision.why
    # Measured in requests (12 turns a second over 32 slots) the same replicas would read
    # 12/s and send 1 - 0.97 x 12 / 20 = 42% of the requests to paid.
    assert paid < 1 - LOAD * 12.0 / 20.0 - 0.1


def test_the_held_work_per_slot_follows_the_mix_of_the_demand() -> None:
    decision = _work_round(None, 20.0, now=NOW, running=1.0, work=1200.0)
    decision = _work_round(decision, 20.0, now=NOW + settled(4.0), running=1.0, work=1200.0)
    # Later the demand is plain requests alone (160 a request): the same work is 30/s.
    plain = KindWork(plain=50, plain_output=50 * 160.0)
    later = _work_round(decision, 20.0, now=NOW + 60, running=0.5, work=300.0, kinds=plain)
    assert later.measured and later.work_per_slot == decision.work_per_slot
    assert later.capacity == pytest.approx(4800 / 160, rel=1e-3)
    assert later.paid == 0.0 and later.plain_share == 1.0


def test_what_the_replicas_computed_bounds_the_capacity_from_below_in_work() -> None:
    # Not full (no sample), the prior 5.6/s; but they computed 2,000 work/s: 6.6/s of the mix.
    decision = _work_round(None, 6.0, now=NOW, running=0.8, work=500.0, completed_work=2000.0)
    assert not decision.measured
    assert decision.capacity == pytest.approx(2000 / 304, rel=1e-3)
    assert decision.paid == 0.0


def test_without_usage_the_unit_stays_requests() -> None:
    few = KindWork(plain=2, plain_output=300.0, sessions=3, session_output=1200.0)
    for kinds in (None, few):
        decision = _work_round(None, 9.0, now=NOW, running=1.0, work=1200.0, kinds=kinds)
        assert decision.work is None
        assert decision.capacity == pytest.approx(PRIOR_SHARE * 8.0)
        assert "in work" not in decision.why
        held = replace(decision, since=NOW)
        later = _work_round(
            held, 9.0, now=NOW + settled(4.0), running=1.0, work=1200.0, kinds=kinds
        )
        # The requests' pool-wide sample saw no completions: still the prior.
        assert later.work_per_slot == pytest.approx(150.0) and not later.measured


# --------------------------------------------------------------------------- the compile

PORTS = (8001, 8002, 8003, 8004)


def _state(
    demand: float,
    *,
    previous: OverflowDecision | None = None,
    now: float = NOW,
    output: float | None = None,
    completed: float = 1000.0,
    scraped: float | None = None,
    total: float | None = None,
    prefilled: float | None = None,
) -> PolicyState:
    objects = [parse_object(body) for body in arrivals_overflow(PORTS)]
    hosts = [f"127.0.0.1:{port}" for port in PORTS]
    return PolicyState.from_objects(
        objects,
        telemetry={
            "owned": {
                host: TelemetryRecord(
                    at=now - 1 if scraped is None else scraped,
                    running=8,
                    max_running=8,
                    output_tokens_per_second=output,
                    output_tokens_total=total,
                    prefilled_tokens_total=prefilled,
                )
                for host in hosts
            }
        },
        now=now,
        arrivals={"default/main/chat": demand},
        service_times={host: 4.0 for host in hosts},
        session_shares={"main/chat": 0.6},
        previous_overflow={"main/chat": previous} if previous is not None else {},
        recent_work={host: Work(1200.0, 0.0) for host in hosts},
        completed_work={host: Work(completed, 0.0) for host in hosts},
        kind_work={"main/chat": CONVERSATIONS},
        # 2 prompt tokens prefilled per output token: 1.2 work per output token at 0.1.
        prefill_per_output={host: 2.0 for host in hosts},
    )


def test_the_compiled_route_sends_the_excess_work_to_paid_plain_requests_first() -> None:
    first = compile_plan(_state(20.0)).overflow["main/chat"]
    assert first.arrivals is not None and first.arrivals.work == pytest.approx(304.0)
    # The lower bound: 4,000 work/s computed, 13.2/s of the mix (the prior is 5.6/s).
    assert first.arrivals.capacity == pytest.approx(4000 / 304, rel=1e-3)
    peak = compile_plan(_state(20.0, previous=first, now=NOW + settled(4.0))).overflow["main/chat"]
    arrivals = peak.arrivals
    assert arrivals is not None and arrivals.measured
    paid = 1 - UTILIZATION * 4800 / (20 * 304)
    assert arrivals.paid == pytest.approx(paid, abs=1e-3)
    # The plain requests carry 21% of the work: all of them go, then conversations.
    share = 6400 / 30400
    assert peak.plain == 1.0
    assert peak.sessions == pytest.approx((paid - share) / (1 - share), abs=2e-3)


def _rates_round(
    previous: ArrivalsDecision | None,
    rate: float,
    now: float,
    *,
    at: float | None = None,
    running: float = 1.0,
) -> ArrivalsDecision:
    """Four replicas of 8 slots, `running` full, computing `rate` work/s each, scraped at
    `at`."""
    return decide_arrivals(
        previous,
        demand=20.0,
        slots=32,
        running=running,
        fill=running,
        completions=None,
        service_time=4.0,  # the prior in work: 0.7 / 4 x 304 = 53.2 a slot
        now=now,
        replicas=[
            ReplicaLoad(f"r{i}", 8, running, work=1200.0, rate=rate, at=at) for i in range(4)
        ],
        kinds=CONVERSATIONS,
    )


def test_a_capacity_from_the_engines_rates_counts_after_three_full_scrapes_from_the_prior() -> None:
    prior = PRIOR_SHARE / 4.0 * 304
    decision = None
    for scrape in range(FULL_SCRAPES - 1):
        decision = _rates_round(decision, 360.0, NOW + scrape, at=NOW + scrape)
        assert not decision.measured and decision.work_per_slot is None
    # The third full scrape in a row counts, averaged in from the prior, not taken outright
    # (a first sample of one replica at a low load read the pool at a third of its rate).
    third = _rates_round(decision, 360.0, NOW + 2, at=NOW + 2)
    assert third.measured
    assert third.work_per_slot == pytest.approx((1 - RATE_WEIGHT) * prior + RATE_WEIGHT * 45)
    # The responses' work (1,200/s a replica) is not mixed in while the rates are there.
    later = _rates_round(third, 400.0, NOW + 3, at=NOW + 3)
    assert later.work_per_slot == pytest.approx(
        (1 - RATE_WEIGHT) * third.work_per_slot + RATE_WEIGHT * 50
    )


def test_a_scrape_counts_once_and_a_replica_not_full_starts_again() -> None:
    decision = None
    for scrape in range(FULL_SCRAPES):
        decision = _rates_round(decision, 360.0, NOW + scrape, at=NOW + scrape)
    assert decision is not None
    held = decision.work_per_slot
    # Rounds between scrapes (an arrival's report, a config change) read the same scrape:
    # it is not averaged in again.
    again = _rates_round(decision, 360.0, NOW + 2.5, at=NOW + 2)
    assert again.work_per_slot == held
    # A replica below full at its scrape starts its count again.
    light = _rates_round(again, 90.0, NOW + 3, at=NOW + 3, running=0.5)
    assert light.scrapes == {} and light.work_per_slot == held
    back = _rates_round(light, 200.0, NOW + 4, at=NOW + 4)
    assert back.work_per_slot == held and back.scrapes["r0"] == (NOW + 4, 1, None, None)


def test_a_counted_rate_is_the_engines_tokens_between_the_scrapes_read() -> None:
    # Scrapes read a second apart; the records' own rates (the interval before each, 900
    # tokens a second: written as a request was admitted, after a run of decode steps) are
    # not a fair sample. The totals say 320 a second were made between them.
    def full(at: float, total: float) -> ReplicaLoad:
        return ReplicaLoad("r0", 8, 1.0, None, rate=900.0 * 1.2, at=at, total=total, per_output=1.2)

    scrapes: dict[str, tuple[float, int, float | None, float | None]] = {}
    counted: list[ReplicaLoad] = []
    for second in range(FULL_SCRAPES):
        scrapes, counted = full_scrapes([full(NOW + second, 1000 + 320 * second)], scrapes, NOW)
    assert [r.rate for r in counted] == [pytest.approx(320 * 1.2)]
    # A restarted engine's total starts again: no rate from the totals, the record's own.
    _, counted = full_scrapes([full(NOW + FULL_SCRAPES, 50)], scrapes, NOW)
    assert [r.rate for r in counted] == [pytest.approx(900 * 1.2)]
    # Without totals (an engine that exports no histogram): the record's own rate.
    plain = [ReplicaLoad("r1", 8, 1.0, None, rate=500.0, at=NOW + s) for s in range(4)]
    state: dict[str, tuple[float, int, float | None, float | None]] = {}
    for replica in plain:
        state, counted = full_scrapes([replica], state, NOW)
    assert [r.rate for r in counted] == [500.0]


def test_a_counted_rate_is_the_engines_output_and_prefill_over_the_same_interval() -> None:
    # Two records a second apart: 320 output tokens and 400 prompt tokens prefilled between
    # them. The responses' work per output token (1.5: a window that held long uncached
    # prompts) is not the interval's: the engine's own counters are.
    def full(at: float, total: float, prefilled: float) -> ReplicaLoad:
        return ReplicaLoad(
            "r0", 8, 1.0, None, at=at, total=total, per_output=1.5, prefilled=prefilled
        )

    scrapes: dict[str, tuple[float, int, float | None, float | None]] = {}
    counted: list[ReplicaLoad] = []
    for second in range(FULL_SCRAPES):
        replica = full(NOW + second, 1000 + 320 * second, 5000 + 400 * second)
        scrapes, counted = full_scrapes([replica], scrapes, NOW)
    assert [r.rate for r in counted] == [pytest.approx(320 + PREFILL_WEIGHT * 400)]
    # The peak's move of the mix: the engine decodes cached conversations (400 tokens a
    # second, nothing prefilled) while the window's responses still say 1.5 work a token.
    # The product would read 600 work/s where the engine computed 400.
    before = full(NOW, 1000, 5000)
    decoding = full(NOW + 1, 1400, 5000)
    assert engine_work(decoding, before.total, before.prefilled, 1.0) == pytest.approx(400.0)
    # A restarted engine's prefill count starts again: the output tokens at the responses'
    # ratio; a restarted output count: nothing from the totals.
    restarted = full(NOW + 1, 1400, 10)
    assert engine_work(restarted, 1000, 5000, 1.0) == pytest.approx(400 * 1.5)
    assert engine_work(full(NOW + 1, 50, 5400), 1000, 5000, 1.0) is None
    # An engine without a prefill count (no prefix-cache counters): the responses' ratio.
    assert engine_work(replace(decoding, prefilled=None), 1000, 5000, 1.0) == pytest.approx(600)


def _full_scrapes_compiled(prefilled: float | None) -> OverflowDecision:
    """The route compiled at ``FULL_SCRAPES`` scrapes a second apart of full replicas whose
    engines made 320 output tokens a second (each record's own rate saying 900) and
    prefilled `prefilled` prompt tokens a second (None: no prefill count)."""
    previous: OverflowDecision | None = None
    for scrape in range(FULL_SCRAPES):
        state = _state(
            20.0,
            output=900.0,
            total=1000.0 + 320 * scrape,
            prefilled=None if prefilled is None else 5000.0 + prefilled * scrape,
            completed=200.0,
            previous=previous,
            now=NOW + scrape,
        )
        previous = compile_plan(state).overflow["main/chat"]
    assert previous is not None
    return previous


def test_the_compiled_route_reads_the_engines_rates_from_their_telemetry() -> None:
    # 320 output tokens a second between the records read (their totals; each record's own
    # rate, 900, is the moment before it was written), 1.2 work per output token: 384 work/s
    # a replica, 48 a slot, counted at the third scrape in a row that found the replicas
    # full (a scrape a second: the record's time is the scrape's), averaged in from the prior.
    previous = _full_scrapes_compiled(prefilled=None)
    arrivals = previous.arrivals
    assert arrivals is not None and arrivals.measured
    held = (1 - RATE_WEIGHT) * PRIOR_SHARE / 4.0 * 304 + RATE_WEIGHT * 48.0
    assert arrivals.work_per_slot == pytest.approx(held)
    assert arrivals.target == pytest.approx(1 - UTILIZATION * held * 32 / (20 * 304), abs=1e-3)
    # A rebuild before the next scrape reads the same records: nothing is averaged in again.
    state = _state(
        20.0,
        output=900.0,
        total=1640.0,
        completed=200.0,
        previous=previous,
        now=NOW + 2.5,
        scraped=NOW + 1,
    )
    again = compile_plan(state).overflow["main/chat"].arrivals
    assert again is not None and again.work_per_slot == arrivals.work_per_slot


def test_the_compiled_route_reads_the_engines_prefill_from_their_telemetry() -> None:
    # The same replicas with a prefill count: 320 output and 400 prompt tokens a second
    # between the records, 360 work/s a replica, 45 a slot, whatever their responses' ratio.
    previous = _full_scrapes_compiled(prefilled=400.0)
    assert previous.arrivals is not None
    held = (1 - RATE_WEIGHT) * PRIOR_SHARE / 4.0 * 304 + RATE_WEIGHT * 45.0
    assert previous.arrivals.work_per_slot == pytest.approx(held)
