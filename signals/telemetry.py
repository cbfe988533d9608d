"""Backend telemetry: the compact record agents write to etcd, and the metric maps that fill it.

An agent scrapes a model server's Prometheus endpoint, reads a handful of numbers through a
``MetricMap`` (built in for vLLM, SGLang and Hugging Face TGI, or user-defined) and writes one
``TelemetryRecord`` per endpoint to ``{prefix}/telemetry/{pool}/{endpoint_id}``, where the
endpoint id is ``address:port``. ``signals.weights`` turns those records into endpoint
weights and health. Nothing here does I/O.

Aggregation: a server may export a metric several times with different labels (one series per
model, or per engine of a data-parallel vLLM). Counts (waiting, running, tokens, counters) are
summed across series; fractions (KV-cache use, hit rates) take the largest value, since the
fullest engine is the one that preempts first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

Samples = dict[str, list[float]]
"""Sample name (``vllm:num_requests_waiting``) -> the values of its series. A histogram's
bucket series are also kept by bound, under `bucket_key` (``name_bucket{le=0.025}``)."""


class TelemetryRecord(BaseModel):
    """One endpoint's load, as last scraped. Every signal is optional: a server exports what it
    exports, and a missing signal simply does not count."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    at: float = Field(description="Wall-clock time of the scrape, Unix seconds.")
    waiting: float | None = Field(None, ge=0, description="Requests queued, not yet running.")
    running: float | None = Field(None, ge=0, description="Requests in the running batch.")
    max_running: float | None = Field(
        None, gt=0, description="Batch capacity (vLLM max_num_seqs), when known."
    )
    kv_cache: float | None = Field(None, ge=0, description="KV-cache use, 0 to 1.")
    pending_tokens: float | None = Field(
        None, ge=0, description="Tokens admitted but not yet generated or prefilled."
    )
    prefix_hit_rate: float | None = Field(
        None, ge=0, le=1, description="Prefix-cache hit rate since the previous scrape, 0 to 1."
    )
    time_per_output_token: float | None = Field(
        None,
        gt=0,
        description="Mean seconds between output tokens since the previous scrape: the "
        "replica's speed, which the weight function compares across a pool.",
    )
    median_time_per_output_token: float | None = Field(
        None,
        gt=0,
        description="Median seconds between output tokens since the previous scrape, "
        "interpolated within the histogram's buckets. A few long steps (a long prompt's "
        "prefill stalls every sequence of the batch) move the mean but not the median, so "
        "the median tells a slow replica from a busy one.",
    )
    output_tokens_per_second: float | None = Field(
        None,
        ge=0,
        description="Output tokens the engine made per second since the previous scrape "
        "(the time-per-output-token histogram's count over the time between the scrapes): "
        "at a full batch, what it computes, whatever the prompts' kinds.",
    )
    output_tokens_total: float | None = Field(
        None,
        ge=0,
        description="Output tokens the engine has made since it started (the "
        "time-per-output-token histogram's count) at this scrape. Two records read apart "
        "give the rate over the time between them, whatever the scrapes in between: a "
        "record is written when a count moves, so the interval before it is no fair "
        "sample of the engine's time.",
    )
    prefilled_tokens_total: float | None = Field(
        None,
        ge=0,
        description="Prompt tokens the engine has prefilled since it started (the prefix "
        "cache's queries less its hits) at this scrape. With ``output_tokens_total`` two "
        "records read apart give the work the engine computed between them, both counts over "
        "the same time.",
    )
    steps_total: float | None = Field(
        None,
        ge=0,
        description="Steps the engine has run since it started (the count of vLLM's "
        "tokens-per-step histogram, ``vllm:iteration_tokens_total``) at this scrape. With "
        "the two token counts, what a step costs whatever it holds, so a batch need not be "
        "full for overflow to learn what a prefilled token costs (``signals.prefillfit``).",
    )
    engines: int | None = Field(
        None,
        ge=1,
        description="Engines behind the replica's one port, where it runs more than one (a "
        "data-parallel vLLM: one series of the steps counter per engine). Its counts are "
        "the engines' sums and its batch size (``max_running``) their total, so a step of "
        "one engine holds at most ``max_running / engines`` sequences.",
    )
    prefill_per_token: float | None = Field(
        None,
        ge=0,
        description="Prompt tokens prefilled since the previous scrape (the prefix cache's "
        "queries less its hits) per output token in the same time: how much of the "
        "replica's steps went to prompts. A replica that prefills several times what its "
        "pool does is busy, not slow, however long its tokens took.",
    )
    ttft: float | None = Field(
        None,
        gt=0,
        description="Mean seconds to first token of the requests whose first token came "
        "since the last scrape that saw one, while the replica has work: what admission "
        "compares with the service-class objective. Unset on an idle replica.",
    )
    format: str = Field("", description="Metric map the record was read with.")
    models: tuple[str, ...] | None = Field(
        None, description="Base models the server lists (signals.discovery), sorted."
    )
    adapters: tuple[str, ...] | None = Field(
        None, description="LoRA adapters the server has loaded (signals.discovery), sorted."
    )
    models_error: str | None = Field(
        None, description="Why the model list could not be read; models: the last list read."
    )

    def to_json(self) -> str:
        """Compact JSON: unset signals are left out."""
        return self.model_dump_json(exclude_none=True)


@dataclass(frozen=True, slots=True)
class MetricMap:
    """Which Prometheus samples feed each field of a ``TelemetryRecord``.

    Each field lists sample names in order of preference; the first one present in a scrape is
    used, so one map covers several versions of a server (vLLM renamed its KV-cache gauge).
    """

    waiting: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    max_running: tuple[str, ...] = ()
    kv_cache: tuple[str, ...] = ()
    kv_cache_scale: float = 1.0
    """Multiplier that turns the KV-cache sample into a fraction (0.01 for a 0-100 percent)."""
    pending_tokens: tuple[str, ...] = ()
    prefix_hit_rate: tuple[str, ...] = ()
    """A gauge that already is a hit rate, 0 to 1."""
    prefix_queries: tuple[str, ...] = ()
    """Counter of prefix-cache lookups; with ``prefix_hits`` gives the hit rate between scrapes."""
    prefix_hits: tuple[str, ...] = ()
    token_seconds: tuple[str, ...] = ()
    """Sum of a time-per-output-token histogram; with ``token_count`` gives the mean time per
    output token between scrapes."""
    token_count: tuple[str, ...] = ()
    token_buckets: tuple[str, ...] = ()
    """Bucket series of that histogram (``..._bucket``): the median time per output token."""
    ttft_seconds: tuple[str, ...] = ()
    """Sum of a time-to-first-token histogram; with ``ttft_count`` gives the mean time to
    first token of the requests that got one between scrapes."""
    ttft_count: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    """Counter of the engine's steps (a tokens-per-step histogram's count)."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> MetricMap:
        """A user-defined map, from YAML or JSON: ``{"waiting": "my_queue_len", "running":
        ["a", "b"], "kv_cache_scale": 0.01}``. Unknown keys are an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown metric map key {unknown[0]!r}; known keys: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name == "kv_cache_scale":
                values[name] = float(value)
            elif isinstance(value, str):
                values[name] = (value,)
            elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
                values[name] = tuple(value)
            else:
                raise ValueError(f"metric map key {name!r} takes a sample name or a list of them")
        return cls(**values)


VLLM = MetricMap(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    # vLLM V1 renamed the gauge; both are fractions despite the "perc" suffix.
    kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    prefix_hit_rate=("vllm:gpu_prefix_cache_hit_rate",),
    # vLLM V1 renamed the histogram; V0 and early V1 use the first name.
    token_seconds=(
        "vllm:time_per_output_token_seconds_sum",
        "vllm:inter_token_latency_seconds_sum",
    ),
    token_count=(
        "vllm:time_per_output_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
    ),
    token_buckets=(
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ),
    ttft_seconds=("vllm:time_to_first_token_seconds_sum",),
    ttft_count=("vllm:time_to_first_token_seconds_count",),
    steps=("vllm:iteration_tokens_total_count",),
)
SGLANG = MetricMap(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    # Fraction of the KV token pool in use.
    kv_cache=("sglang:token_usage",),
    prefix_hit_rate=("sglang:cache_hit_rate",),
)
TGI = MetricMap(
    waiting=("tgi_queue_size",),
    running=("tgi_batch_current_size",),
    pending_tokens=("tgi_batch_current_max_tokens",),
)
METRIC_MAPS: Mapping[str, MetricMap] = {"vllm": VLLM, "sglang": SGLANG, "tgi": TGI}
"""Built-in maps by ``TelemetrySource.format``; ``custom`` takes a user-defined map."""

_COUNTS = ("waiting", "running", "max_running", "pending_tokens")
_FRACTIONS = ("prefix_hit_rate",)


def parse_samples(text: str) -> Samples:
    """Prometheus text exposition -> sample values by name. ``ValueError`` on malformed text.

    ``_created`` series (counter creation times) are dropped: they are not measurements.
    """
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out.setdefault(sample.name, []).append(float(sample.value))
            bound = sample.labels.get("le") if sample.name.endswith("_bucket") else None
            if bound is not None:
                out.setdefault(bucket_key(sample.name, float(bound)), []).append(
                    float(sample.value)
                )
    return out


def bucket_key(name: str, bound: float) -> str:
    """Where `parse_samples` keeps the bucket series of histogram ``name`` (``..._bucket``)
    with upper bound ``bound``: ``name{le=bound}``."""
    return f"{name}{{le={bound!r}}}"


Buckets = tuple[tuple[float, float], ...]
"""A cumulative histogram: (upper bound, observations at or below it), bounds ascending,
the last one infinite."""


def _buckets(samples: Samples, names: Iterable[str]) -> Buckets | None:
    """The first histogram of ``names`` found, its series summed bucket by bucket."""
    for name in names:
        prefix = f"{name}{{le="
        found = [
            (float(key[len(prefix) : -1]), sum(values))
            for key, values in samples.items()
            if key.startswith(prefix)
        ]
        if found:
            return tuple(sorted(found))
    return None


MEDIAN_MIN_OBSERVATIONS = 8
"""Fewer observations than this between two scrapes give no median: too few to tell. Low
enough for a replica decoding one sequence at a third of its speed (about 15 tokens a
second), whose slowdown must show; a few long steps among eight still leave the median."""


def _median(now: Buckets | None, before: Buckets | None) -> float | None:
    """The median of what a cumulative histogram observed between two scrapes, linearly
    interpolated within its bucket (as Prometheus's ``histogram_quantile`` does; the first
    bucket starts at 0). None on too few observations, a restart or changed bounds."""
    if now is None or before is None or [b for b, _ in now] != [b for b, _ in before]:
        return None
    grown = [(bound, count - old) for (bound, count), (_, old) in zip(now, before, strict=True)]
    if not grown or any(count < 0 for _, count in grown) or not math.isinf(grown[-1][0]):
        return None
    total = grown[-1][1]
    if total < MEDIAN_MIN_OBSERVATIONS:
        return None
    rank = total / 2
    lower, below = 0.0, 0.0
    for bound, count in grown:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return None


def _first(samples: Samples, names: Iterable[str]) -> list[float] | None:
    for name in names:
        values = samples.get(name)
        if values:
            return values
    return None


@dataclass(frozen=True, slots=True)
class Counters:
    """Counters of the previous scrape, to turn totals into rates between scrapes."""

    queries: float | None = None
    """Prefix-cache lookups."""
    hits: float | None = None
    """Prefix-cache hits."""
    token_seconds: float | None = None
    """Sum of the time-per-output-token histogram."""
    token_count: float | None = None
    """Output tokens observed by that histogram."""
    token_buckets: Buckets | None = None
    """Its buckets."""
    ttft_seconds: float | None = None
    """Sum of the time-to-first-token histogram when a first token was last seen."""
    ttft_count: float | None = None
    """First tokens observed by that histogram then."""
    ttft: float | None = None
    """The mean time to first token measured then, carried while no new first token comes."""
    at: float | None = None
    """When that scrape was taken (wall-clock seconds)."""


def _delta(now: float | None, before: float | None) -> float | None:
    """How much a counter grew; None when unknown or when it went back (a restart)."""
    if now is None or before is None or now < before:
        return None
    return now - before


def extract(
    samples: Samples,
    metric_map: MetricMap,
    *,
    at: float,
    previous: Counters | None = None,
    format: str = "",
    max_running: float | None = None,
) -> tuple[TelemetryRecord, Counters]:
    """Read a record out of one scrape. Returns the record and the counters to pass as
    ``previous`` next time. ``max_running`` is the batch capacity when the server does not
    export it (vLLM's ``--max-num-seqs``)."""
    values: dict[str, Any] = {"at": at, "format": format}
    for name in _COUNTS:
        found = _first(samples, getattr(metric_map, name))
        if found is not None:
            values[name] = max(0.0, sum(found))
    for name in _FRACTIONS:
        found = _first(samples, getattr(metric_map, name))
        if found is not None:
            values[name] = min(1.0, max(0.0, max(found)))
    kv = _first(samples, metric_map.kv_cache)
    if kv is not None:
        values["kv_cache"] = max(0.0, max(kv) * metric_map.kv_cache_scale)
    if max_running is not None and "max_running" not in values:
        values["max_running"] = max_running
    if values.get("max_running") == 0:
        del values["max_running"]

    def total(names: Iterable[str]) -> float | None:
        found = _first(samples, names)
        return sum(found) if found is not None else None

    counters = Counters(
        queries=total(metric_map.prefix_queries),
        hits=total(metric_map.prefix_hits),
        token_seconds=total(metric_map.token_seconds),
        token_count=total(metric_map.token_count),
        token_buckets=_buckets(samples, metric_map.token_buckets),
        ttft_seconds=total(metric_map.ttft_seconds),
        ttft_count=total(metric_map.ttft_count),
        at=at,
    )
    if counters.token_count is not None:
        values["output_tokens_total"] = counters.token_count
    engine_steps = _first(samples, metric_map.steps)
    if engine_steps is not None:
        values["steps_total"] = max(0.0, sum(engine_steps))
        if len(engine_steps) > 1:
            values["engines"] = len(engine_steps)
    if counters.queries is not None and counters.hits is not None:
        values["prefilled_tokens_total"] = max(0.0, counters.queries - counters.hits)
    if previous is not None:
        counters = _time_to_first_token(counters, previous, busy=_busy(values))
        if counters.ttft is not None:
            values["ttft"] = counters.ttft
        asked = _delta(counters.queries, previous.queries)
        found_hits = _delta(counters.hits, previous.hits)
        if asked and found_hits is not None:
            values["prefix_hit_rate"] = min(1.0, found_hits / asked)
        seconds = _delta(counters.token_seconds, previous.token_seconds)
        tokens = _delta(counters.token_count, previous.token_count)
        if tokens and seconds:
            values["time_per_output_token"] = seconds / tokens
        if tokens is not None and previous.at is not None and at > previous.at:
            values["output_tokens_per_second"] = round(tokens / (at - previous.at), 4)
        if tokens and asked is not None and found_hits is not None:
            values["prefill_per_token"] = round(max(0.0, asked - found_hits) / tokens, 6)
        median = _median(counters.token_buckets, previous.token_buckets)
        if median:
            values["median_time_per_output_token"] = median
    return TelemetryRecord.model_validate(values), counters


def _busy(values: Mapping[str, Any]) -> bool:
    """True unless the scrape shows an idle replica (nothing running, nothing waiting);
    a server that exports neither count is taken as busy."""
    waiting, running = values.get("waiting"), values.get("running")
    if waiting is None and running is None:
        return True
    return bool(waiting) or bool(running)


def _time_to_first_token(counters: Counters, previous: Counters, *, busy: bool) -> Counters:
    """``counters`` with the mean time to first token since the last scrape that saw one.

    At a scrape every second, most replicas see no new first token in most intervals, and
    a queue that grows slowly shows no first token at all for a while: so the window grows
    until a first token comes (the previous totals are kept), and the last mean is carried
    meanwhile. An idle replica has no time to first token to speak of: nothing is carried,
    or a pool would stay "saturated" on the memory of its last burst once traffic stops.
    """
    seconds = _delta(counters.ttft_seconds, previous.ttft_seconds)
    count = _delta(counters.ttft_count, previous.ttft_count)
    if counters.ttft_count is None or counters.ttft_seconds is None:
        return counters
    if previous.ttft_count is None or count is None or seconds is None:
        return counters  # the first scrape, or a restart: start a new window
    if count > 0:
        return replace(counters, ttft=seconds / count if seconds > 0 else None)
    return replace(
        counters,
        ttft_seconds=previous.ttft_seconds,
        ttft_count=previous.ttft_count,
        ttft=previous.ttft if busy else None,
    )


def metric_map_for(format: str, custom: MetricMap | None = None) -> MetricMap:
    """The map of a ``TelemetrySource.format``; ``custom`` needs a user-defined map."""
    if format == "custom":
        if custom is None:
            raise ValueError("format 'custom' needs a metric map (--metric-map FILE)")
        return custom
    try:
        return METRIC_MAPS[format]
    except KeyError:
        known = ", ".join([*METRIC_MAPS, "custom"])
        raise ValueError(f"unknown telemetry format {format!r}; known: {known}") from None


__all__ = [
    "MEDIAN_MIN_OBSERVATIONS",
    "METRIC_MAPS",
    "SGLANG",
    "TGI",
    "VLLM",
    "Buckets",
    "Counters",
    "MetricMap",
    "Samples",
    "TelemetryRecord",
    "bucket_key",
    "extract",
    "metric_map_for",
    "parse_samples",
]
