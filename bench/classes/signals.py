"""What the pool looked like while a service-class run lasted, and which signal leads the
interactive class's time to first token.

`SignalSampler` reads, every fraction of a second, kvpilot's admission gauges (pressure,
the batch class's admitted share) and every replica's ``/metrics`` (requests waiting and
running, KV-cache use, the TTFT histogram). `lead_table` then asks of each pool signal how
well it foretells the interactive TTFT of the requests that arrive next: the correlation
between the signal at ``t`` and the 90th percentile of the interactive TTFT of requests
arriving in ``[t + lag, t + lag + 1s)``, for a few lags. A signal that correlates best at a
positive lag rises before the first tokens slow down; one that barely correlates is not
the one to shed on.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import threading
import time
from collections.abc import Mapping, Sequence

import httpx

from bench.classes.config import BATCH, INTERACTIVE, ClassesConfig, class_of
from bench.classes.results import SignalLead
from bench.rig.loadgen import RequestResult, parse_metrics
from bench.rig.report import num, table
from bench.rig.stack import POLICY_NAME
from bench.rig.summary import percentile

LAGS = (0.0, 0.5, 1.0, 2.0, 3.0)
"""Simulated seconds between the signal and the requests it is compared with."""
WINDOW = 1.0
"""Simulated seconds of arrivals whose interactive TTFT each sample is compared with."""
SIGNALS = ("waiting", "running", "kv_cache", "ttft", "waiting_top", "kv_cache_top")
"""Pool means: requests waiting, requests running, KV-cache use, engine TTFT (all classes);
then waiting and KV-cache use over the busiest quarter of the replicas alone (`top_mean`),
to see whether per-replica pressure would lead the pool mean."""


def top_mean(values: Sequence[float]) -> float:
    """The mean of the largest quarter of `values` (at least one)."""
    ordered = sorted(values, reverse=True)
    return statistics.fmean(ordered[: max(1, math.ceil(len(ordered) / 4))])


class SignalSampler:
    """Reads kvpilot's admission gauges and the replicas' metrics while a run lasts."""

    def __init__(
        self,
        api_url: str,
        replica_urls: Sequence[str],
        time_scale: float,
        interval: float,
        route: str = "chat",
    ) -> None:
        self.api_url = api_url
        self.route = route
        """The route of the policy whose admission gauges are read: the one batch takes."""
        self.replica_urls = list(replica_urls)
        self.time_scale = time_scale
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SignalSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def align(self, started: float) -> None:
        """Count the samples' time from `started` (``time.monotonic()``), the moment the
        replay's simulated time 0 falls on, as `bench.rig.loadgen.replay`'s ``on_start`` gives."""
        shift = (started - self._started) / self.time_scale
        self._started = started
        for sample in list(self.samples):
            sample["at"] -= shift

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        route = f"{POLICY_NAME}/{self.route}"
        ttft_before: tuple[float, float] | None = None
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.interval):
                sample: dict[str, float] = {
                    "at": (time.monotonic() - self._started) / self.time_scale
                }
                with contextlib.suppress(httpx.HTTPError):
                    for line in client.get(f"{self.api_url}/metrics").text.splitlines():
                        if f'route="{route}"' not in line or line.startswith("#"):
                            continue
                        name, _, value = line.rpartition(" ")
                        if name.startswith("kvpilot_admission_pressure"):
                            sample["pressure"] = float(value)
                        elif f'service_class="{BATCH}"' in name and "admitted_ratio" in name:
                            sample["batch_admitted"] = float(value)
                replicas = []
                for url in self.replica_urls:
                    with contextlib.suppress(httpx.HTTPError):
                        replicas.append(parse_metrics(client.get(f"{url}/metrics").text))
                if replicas:
                    sample["waiting"] = statistics.fmean(
                        m.get("vllm:num_requests_waiting", 0.0) for m in replicas
                    )
                    sample["running"] = statistics.fmean(
                        m.get("vllm:num_requests_running", 0.0) for m in replicas
                    )
                    sample["kv_cache"] = statistics.fmean(
                        m.get("vllm:kv_cache_usage_perc", 0.0) for m in replicas
                    )
                    sample["waiting_top"] = top_mean(
                        [m.get("vllm:num_requests_waiting", 0.0) for m in replicas]
                    )
                    sample["kv_cache_top"] = top_mean(
                        [m.get("vllm:kv_cache_usage_perc", 0.0) for m in replicas]
                    )
                    totals = (
                        sum(m.get("vllm:time_to_first_token_seconds_sum", 0.0) for m in replicas),
                        sum(m.get("vllm:time_to_first_token_seconds_count", 0.0) for m in replicas),
                    )
                    if ttft_before is not None and totals[1] > ttft_before[1]:
                        sample["ttft"] = (totals[0] - ttft_before[0]) / (totals[1] - ttft_before[1])
                    ttft_before = totals
                self.samples.append(sample)


def _pearson(pairs: list[tuple[float, float]]) -> float | None:
    if len(pairs) < 5:
        return None
    xs, ys = zip(*pairs, strict=True)
    sx, sy = statistics.pstdev(xs), statistics.pstdev(ys)
    if sx == 0 or sy == 0:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    covariance = sum((x - mx) * (y - my) for x, y in pairs) / len(pairs)
    return float(covariance / (sx * sy))


def lead_table(
    samples: Sequence[dict[str, float]], results: Sequence[RequestResult]
) -> dict[str, SignalLead]:
    """Per pool signal: its peak, and its correlation with the interactive TTFT p90 of the
    requests arriving ``lag`` simulated seconds later, by lag (see the module notes)."""
    arrivals = sorted(
        (r.start, ttft)
        for r in results
        if class_of(r) == INTERACTIVE
        and r.ok
        and (ttft := r.engine_ttft if r.engine_ttft is not None else r.ttft) is not None
    )

    def target(at: float) -> float | None:
        window = [t for start, t in arrivals if at <= start < at + WINDOW]
        return percentile(window, 90) if len(window) >= 2 else None

    out: dict[str, SignalLead] = {}
    for signal in SIGNALS:
        values = [(s["at"], s[signal]) for s in samples if signal in s]
        by_lag: dict[str, float | None] = {}
        for lag in LAGS:
            pairs = [(v, y) for at, v in values if (y := target(at + lag)) is not None]
            r = _pearson(pairs)
            by_lag[f"{lag:g}"] = None if r is None else round(r, 3)
        known = {lag: r for lag, r in by_lag.items() if r is not None}
        out[signal] = SignalLead(
            peak=max((v for _, v in values), default=None),
            correlation_by_lag=by_lag,
            best_lag=max(known, key=lambda lag: known[lag]) if known else None,
        )
    return out


def signals_markdown(signals: Mapping[str, SignalLead], config: ClassesConfig) -> list[str]:
    """The lead table as Markdown lines."""
    lines = [
        "## Which signal leads interactive TTFT (affinity alone, no admission)",
        "",
        "Correlation of each pool signal (the mean over the replicas, or over the busiest "
        "quarter of them) with the interactive TTFT p90 of the requests arriving that many "
        f"simulated seconds later (over {WINDOW:g}s of arrivals):",
        "",
    ]
    names = {
        "waiting": "requests waiting",
        "running": "requests running",
        "kv_cache": "KV-cache use",
        "ttft": "engine TTFT, all classes",
        "waiting_top": "requests waiting, busiest quarter",
        "kv_cache_top": "KV-cache use, busiest quarter",
    }
    lines += table(
        ("signal", "peak", *(f"lag {lag:g}s" for lag in LAGS), "best lag"),
        (
            (
                names.get(signal, signal),
                num(row.peak),
                *(num(row.correlation_by_lag.get(f"{lag:g}"), "{:.2f}") for lag in LAGS),
                "n/a" if row.best_lag is None else row.best_lag + "s",
            )
            for signal, row in signals.items()
        ),
        "lr" + "r" * len(LAGS) + "r",
    )
    return lines


def admission_summary(
    samples: Sequence[dict[str, float]], overload: tuple[float, float] = (0.0, math.inf)
) -> str:
    """One line on what admission did: peak pressure, least batch share, the mean share
    through the overload (`overload`: its start and end, simulated seconds), when batch was
    first restricted (counted from the overload's start) and how often its share changed."""
    pressures = [s["pressure"] for s in samples if "pressure" in s]
    shares = [(s["at"], s["batch_admitted"]) for s in samples if "batch_admitted" in s]
    if not pressures and not shares:
        return "none"
    start, end = overload
    restricted = [at - start for at, share in shares if share < 1.0]
    changes = sum(1 for (_, a), (_, b) in itertools.pairwise(shares) if a != b)
    least = min((share for _, share in shares), default=math.nan)
    during = [share for at, share in shares if start <= at < end]
    first = restricted[0] if restricted else None
    return (
        f"peak pressure {num(max(pressures, default=None), '{:.2f}')}, batch admitted down "
        f"to {least:.0%}, {statistics.fmean(during) if during else math.nan:.0%} on average "
        f"through the overload, first restricted {num(first, '{:.1f}')}s into it, "
        f"{changes} share changes"
    )
