"""The numbers of one replay: percentiles, hit rates, throughput and how evenly the replicas
were loaded, from the load generator's results and the replicas' metrics (pure, no I/O)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from bench.rig.jsonfields import known
from bench.rig.loadgen import RequestResult, RunResult


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, kw_only=True)
class Summary:
    """The numbers of one replay (times in simulated seconds). The last three fields are the
    raw series behind them, which results files keep apart (`RAW`)."""

    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    """The five commonest errors and their counts."""
    answers_match: int
    timed_out: bool
    hit_rate: float | None
    """Prefix-cache hits over queries, from the replicas' counters."""
    client_hit_rate: float
    """Cached prompt tokens over prompt tokens, as the answers' usage reported them."""
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    latency_p50: float | None
    latency_p99: float | None
    throughput_tokens_per_s: float | None
    requests_per_s: float | None
    makespan_s: float
    wall_seconds: float
    served: dict[str, int]
    mean_in_flight: dict[str, float]
    load_max_over_mean: float | None
    served_max_over_mean: float | None
    busy_fraction: dict[str, float]
    busy_fraction_mean: float | None
    ttfts: list[float] = field(default_factory=list)
    per_request: list[RequestResult] = field(default_factory=list)
    load_series: list[dict[str, float]] = field(default_factory=list)
    """Every load sample: ``at`` and each replica's in-flight requests."""

    def to_json(self) -> dict[str, Any]:
        """The numbers without the raw series."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in RAW}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Summary:
        """The numbers as `to_json` wrote them (the raw series stay empty)."""
        return cls(**known(cls, data, *RAW))


RAW = ("ttfts", "per_request", "load_series")
"""`Summary`'s raw series, which its JSON leaves out."""


def summarize(run: RunResult, metrics: dict[str, dict[str, float]]) -> Summary:
    """The numbers the report shows for one policy (times in simulated seconds)."""
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok if r.latency is not None]
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in metrics.values())
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in metrics.values())
    if run.results:
        first = min(r.start for r in run.results)
        last = max(r.start + (r.latency or 0.0) for r in run.results)
        makespan = max(1e-9, last - first)
    else:
        makespan = 0.0
    tokens = sum(r.completion_tokens for r in ok)
    served = Counter(r.replica for r in ok)
    replica_ids = sorted(metrics)
    mean_in_flight = {
        rid: statistics.fmean([s.in_flight.get(rid, 0.0) for s in run.samples] or [0.0])
        for rid in replica_ids
    }
    busy = {
        rid: m.get("kvpilot_sim_busy_seconds_total", 0.0)
        / max(1e-9, m.get("kvpilot_sim_elapsed_seconds", 0.0))
        for rid, m in metrics.items()
    }

    def max_over_mean(values: list[float]) -> float | None:
        mean = statistics.fmean(values) if values else 0.0
        return max(values) / mean if mean > 0 else None

    errors = Counter(r.error or f"HTTP {r.status}" for r in run.results if not r.ok)
    return Summary(
        requests=len(run.results),
        ok=len(ok),
        errors=sum(errors.values()),
        error_kinds=dict(errors.most_common(5)),
        answers_match=sum(1 for r in ok if r.answer_matches),
        timed_out=run.timed_out,
        hit_rate=hits / queries if queries else None,
        client_hit_rate=(
            sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))
        ),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        throughput_tokens_per_s=tokens / makespan if makespan else None,
        requests_per_s=len(ok) / makespan if makespan else None,
        makespan_s=makespan,
        wall_seconds=run.wall_seconds,
        served={rid: served.get(rid, 0) for rid in replica_ids},
        mean_in_flight=mean_in_flight,
        load_max_over_mean=max_over_mean(list(mean_in_flight.values())),
        served_max_over_mean=max_over_mean([float(served.get(r, 0)) for r in replica_ids]),
        busy_fraction=busy,
        busy_fraction_mean=statistics.fmean(busy.values()) if busy else None,
        ttfts=ttfts,
        per_request=list(run.results),
        load_series=[
            {"at": s.at, **{rid: s.in_flight.get(rid, 0.0) for rid in replica_ids}}
            for s in run.samples
        ],
    )
