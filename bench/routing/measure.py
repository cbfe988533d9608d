"""The scenario suite's numbers for one policy in one run: latency, throughput, goodput,
hit rate, moved turns, the slow period of a slowdown, and how kvpilot's weights moved.
Pure functions of what the replay and the replicas recorded."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.rig.analysis import classify
from bench.rig.loadgen import RequestResult, RunResult
from bench.rig.summary import percentile, summarize
from bench.routing.results import (
    AroundSlowdown,
    Measured,
    SlowPeriod,
    Timeline,
    WeightMoves,
)
from bench.routing.scenarios import Scenario, SlowEvent


def weight_moves(timeline: Timeline, event: SlowEvent | None) -> WeightMoves:
    """How often kvpilot changed a replica's weight during the run, and around a slowdown
    how long the slowed replica's weight took to fall and to come back, and its share of the
    ring from 5 s after the slowdown to its end against its share before (``ring_share_drop``:
    what a new session's chance to land there became, free of the few sessions a window
    holds)."""
    changes = 0
    for (_, before), (_, after) in itertools.pairwise(timeline):
        changes += sum(1 for a, b in zip(before, after, strict=True) if a != b)
    if event is None or not timeline:
        return WeightMoves(changes)
    full = max(w[event.replica] for _, w in timeline)
    fell = next((t for t, w in timeline if t >= event.start and w[event.replica] < full), None)
    back = next((t for t, w in timeline if t >= event.end and w[event.replica] >= full), None)

    def share(start: float, end: float) -> float | None:
        shares = [
            w[event.replica] / total
            for t, w in timeline
            if start <= t < end and (total := sum(w)) > 0
        ]
        return statistics.fmean(shares) if shares else None

    usual, slowed = share(-math.inf, event.start), share(event.start + 5.0, event.end)
    return WeightMoves(
        changes,
        AroundSlowdown(
            fell_after=None if fell is None else fell - event.start,
            back_after=None if back is None else back - event.end,
            ring_share_drop=slowed / usual if usual and slowed is not None else None,
        ),
    )


def measure(
    run: RunResult,
    metrics: dict[str, dict[str, float]],
    scenario: Scenario,
    policy: str,
    oracle: float,
    slo: float,
    ramp: float = 0.0,
    *,
    seed: int,
    batch: int,
) -> Measured:
    """The suite's numbers for one policy in one run (times in simulated seconds), over the
    steady part of the run: requests started from `ramp` on (the ramp-up is the fleet
    filling, not the load the scenario names), load samples from then on."""
    whole = run
    run = replace(
        run,
        results=[r for r in run.results if r.start >= ramp],
        samples=[s for s in run.samples if s.at >= ramp],
    )
    summary = summarize(run, metrics)
    ok = [r for r in run.results if r.ok]
    # Times as the engines measured them (see `engine_timing` in replicasim.simulator): several
    # fleets at once on a shared machine slow the Python HTTP path by seconds, equally for
    # every policy, and that would drown what routing changes. The client's are kept too.
    ttft = {id(r): r.engine_ttft if r.engine_ttft is not None else r.ttft for r in ok}
    latency = [r.engine_latency if r.engine_latency is not None else r.latency for r in ok]
    ttfts = [t for t in ttft.values() if t is not None]
    rows = classify(run.results)
    later = [r for r in rows if r.request.turn > 0]
    moved = sum(1 for r in later if r.kind == "moved")
    # Completed requests per second: those that finished (as the engines timed it: the
    # client's receipt would add the harness's delays) between the ramp and the last turn
    # sent, over that window; without a ramp, from the first request to the last token.
    end = scenario.workload.duration if ramp else None
    ends = [
        r.start + (r.engine_latency if r.engine_latency is not None else r.latency or 0.0)
        for r in whole.results
        if r.ok
    ]
    if end is not None:
        makespan = end - ramp
        done = sum(1 for t in ends if ramp <= t <= end)
    else:
        makespan = max(ends) - min(r.start for r in ok) if ok else 0.0
        done = len(ok)
    ttft_count = sum(m.get("vllm:time_to_first_token_seconds_count", 0.0) for m in metrics.values())
    ttft_sum = sum(m.get("vllm:time_to_first_token_seconds_sum", 0.0) for m in metrics.values())
    # How much of the engines' time went to prompt tokens: what a better cache hit rate can
    # give back at full batches (the rest is decode steps, the same for every router).
    busy = sum(m.get("kvpilot_sim_busy_seconds_total", 0.0) for m in metrics.values())
    prefill = [
        m["kvpilot_sim_prefill_seconds_total"]
        for m in metrics.values()
        if "kvpilot_sim_prefill_seconds_total" in m
    ]
    good = goodput(run.results, slo, makespan)
    return Measured(
        requests=summary.requests,
        ok=summary.ok,
        errors=summary.errors,
        error_kinds=summary.error_kinds,
        timed_out=summary.timed_out,
        # The engines' prefix-cache counters cover the ramp-up too: the steady part's hit
        # rate is the share of its prompt tokens the replicas reported cached.
        hit_rate=summary.client_hit_rate if ok else None,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        latency_p99=percentile([t for t in latency if t is not None], 99),
        requests_per_s=done / makespan if makespan else None,
        makespan_s=makespan,
        load_max_over_mean=summary.load_max_over_mean,
        served=summary.served,
        wall_seconds=summary.wall_seconds,
        in_flight_mean=(
            statistics.fmean(summary.mean_in_flight.values()) if summary.mean_in_flight else None
        ),
        # The engines' own mean TTFT: the client's minus this is the harness (HTTP, Envoy, a
        # busy machine), the same for every policy of the run.
        engine_ttft_mean=ttft_sum / ttft_count if ttft_count else None,
        ttft_mean=statistics.fmean(ttfts) if ttfts else None,
        client_ttft_p50=summary.ttft_p50,
        client_ttft_p99=summary.ttft_p99,
        goodput_per_s=good.per_s,
        goodput_share=good.share,
        hit_vs_oracle=(summary.hit_rate or 0.0) / oracle if oracle else None,
        oracle_hit_rate=oracle,
        engine_hit_rate=summary.hit_rate,
        prefill_share=sum(prefill) / busy if prefill and busy else None,
        moved=moved,
        moved_share=moved / len(later) if later else 0.0,
        slow=None if scenario.event is None else _slow_period(ok, ttft, scenario.event, policy),
        per_request=list(run.results),
        seed=seed,
        batch=batch,
    )


def _slow_period(
    ok: list[RequestResult], ttft: dict[int, float | None], event: SlowEvent, policy: str
) -> SlowPeriod:
    """The TTFTs and the slowed replica's share of new sessions around `event`."""
    slowed = f"{policy}-{event.replica}"

    def window(start: float, end: float) -> list[RequestResult]:
        return [r for r in ok if start <= r.start < end and ttft[id(r)] is not None]

    def p99(start: float, end: float) -> float | None:
        return percentile([t for r in window(start, end) if (t := ttft[id(r)]) is not None], 99)

    def new_sessions(start: float, end: float) -> tuple[int, int]:
        """(first turns the slowed replica answered, all first turns) in the window."""
        first = [r for r in window(start, end) if r.turn == 0]
        return sum(1 for r in first if r.replica == slowed), len(first)

    def new_share(start: float, end: float) -> float | None:
        mine, every = new_sessions(start, end)
        return mine / every if every else None

    return SlowPeriod(
        ttft_p99_before=p99(0, event.start),
        ttft_p99_during=p99(event.start, event.end),
        ttft_p99_after=p99(event.end, event.end + 10.0),
        new_share_before=new_share(0, event.start),
        new_share_first_5s=new_share(event.start, event.start + 5.0),
        new_share_after_5s=new_share(event.start + 5.0, event.end),
        new_share_recovered=new_share(event.end, float("inf")),
        # The counts behind the two shares the target compares, to pool seeds by: each
        # window holds a few dozen new sessions, the slowed replica's share of them a few.
        new_sessions_before=new_sessions(0, event.start),
        new_sessions_after_5s=new_sessions(event.start + 5.0, event.end),
    )


@dataclass(frozen=True)
class Goodput:
    """Goodput at one objective."""

    per_s: float | None
    """Good requests per second of the measured window."""
    share: float | None
    """Good requests as a share of all."""


def engine_ttft(r: RequestResult) -> float | None:
    """A request's TTFT as its engine timed it, the client's where the engine gave none."""
    return r.engine_ttft if r.engine_ttft is not None else r.ttft


def goodput(per_request: Sequence[RequestResult], slo: float, window: float) -> Goodput:
    """Goodput at objective `slo`: the requests that succeeded with their first token within
    `slo` as the engines timed it (the client's time where an engine gave none), per second of
    the measured `window`, and as a share of all."""
    good = sum(1 for r in per_request if r.ok and (t := engine_ttft(r)) is not None and t <= slo)
    return Goodput(
        per_s=good / window if window else None,
        share=good / len(per_request) if per_request else None,
    )


def summary_line(m: Measured) -> str:
    def f(value: float | None, pattern: str) -> str:
        return "n/a" if value is None else pattern.format(value)

    text = (
        f"TTFT p50 {f(m.ttft_p50, '{:.3f}')} p99 {f(m.ttft_p99, '{:.3f}')} s, "
        f"E2E p99 {f(m.latency_p99, '{:.2f}')} s, {f(m.requests_per_s, '{:.2f}')} req/s, "
        f"goodput {f(m.goodput_share, '{:.1%}')}, hit {f(m.hit_rate, '{:.1%}')}, "
        f"load max/mean {f(m.load_max_over_mean, '{:.2f}')}, "
        f"in flight {f(m.in_flight_mean, '{:.1f}')}/replica, moved {m.moved}, "
        f"errors {m.errors}; at the client TTFT p50 {f(m.client_ttft_p50, '{:.3f}')} "
        f"p99 {f(m.client_ttft_p99, '{:.3f}')} s"
    )
    weights = m.weights
    if weights:
        text += f"; weight changes {weights.weight_changes}"
        if weights.slowdown is not None:
            text += (
                f", slowed replica's weight fell {f(weights.slowdown.fell_after, '{:.1f}')} s "
                f"after the slowdown, back {f(weights.slowdown.back_after, '{:.1f}')} s after "
                "recovery"
            )
    slow = m.slow
    if slow:
        text += (
            f"; slow period p99 {f(slow.ttft_p99_during, '{:.3f}')} s, new-session share "
            f"{f(slow.new_share_before, '{:.0%}')} -> {f(slow.new_share_after_5s, '{:.0%}')}"
        )
    return text
