"""Backend telemetry: the compact record agents write to etcd, and the metric maps that fill it.

An agent scrapes a model server's Prometheus endpoint, reads a handful of numbers through a
``MetricMap`` (built in for vLLM, SGLang and Hugging Face TGI, or user-defined) and writes one
``TelemetryRecord`` per endpoint to ``{prefix}/telemetry/{pool}/{endpoint_id}``, where the
endpoint id is ``address:port``. ``policies.weights`` turns those records into endpoint
weights and health. Nothing here does I/O.

Aggregation: a server may export a metric several times with different labels (one series per
model, or per engine of a data-parallel vLLM). Counts (waiting, running, tokens, counters) are
summed across series; fractions (KV-cache use, hit rates) take the largest value, since the
fullest engine is the one that preempts first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

Samples = dict[str, list[float]]
"""Sample name (``vllm:num_requests_waiting``) -> the values of its series."""


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
    format: str = Field("", description="Metric map the record was read with.")

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
    return out


def _first(samples: Samples, names: Iterable[str]) -> list[float] | None:
    for name in names:
        values = samples.get(name)
        if values:
            return values
    return None


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    """Prefix-cache counters of the previous scrape, to turn totals into a rate."""

    queries: float
    hits: float


def extract(
    samples: Samples,
    metric_map: MetricMap,
    *,
    at: float,
    previous: PrefixCounters | None = None,
    format: str = "",
    max_running: float | None = None,
) -> tuple[TelemetryRecord, PrefixCounters | None]:
    """Read a record out of one scrape. Returns the record and the prefix counters to pass as
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
    counters = None
    queries = _first(samples, metric_map.prefix_queries)
    hits = _first(samples, metric_map.prefix_hits)
    if queries is not None and hits is not None:
        counters = PrefixCounters(sum(queries), sum(hits))
        if previous is not None:
            asked = counters.queries - previous.queries
            found_hits = counters.hits - previous.hits
            # A counter that went back means the server restarted: no rate this time.
            if asked > 0 and found_hits >= 0:
                values["prefix_hit_rate"] = min(1.0, found_hits / asked)
    return TelemetryRecord.model_validate(values), counters


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
    "METRIC_MAPS",
    "SGLANG",
    "TGI",
    "VLLM",
    "MetricMap",
    "PrefixCounters",
    "Samples",
    "TelemetryRecord",
    "extract",
    "metric_map_for",
    "parse_samples",
]


@dataclass(frozen=True, slots=True)
class WriteBand:
    """How far a record must move from the one last written before an agent writes it again.

    At 10,000 endpoints scraped every second, writing every wiggle is 10,000 etcd writes and
    as many reconciler wakeups a second, for changes the weight function's own quantization
    band throws away. Counts (waiting, running, pending tokens) move when they change by more
    than ``relative`` of the larger value and by at least their floor, so a short queue still
    counts every request; fractions (KV-cache use, prefix hit rate) when they move by more than
    ``fraction``. Capacity and format changes always count.
    """

    relative: float = 0.1
    requests: float = 1.0
    """Floor for waiting and running requests."""
    tokens: float = 256.0
    """Floor for pending tokens."""
    fraction: float = 0.05
    """Absolute band for KV-cache use and prefix hit rate."""

    def moved(self, last: TelemetryRecord, record: TelemetryRecord) -> bool:
        """True when `record` differs from `last` beyond the band (the time does not count)."""
        if (last.max_running, last.format) != (record.max_running, record.format):
            return True
        counts = (
            (last.waiting, record.waiting, self.requests),
            (last.running, record.running, self.requests),
            (last.pending_tokens, record.pending_tokens, self.tokens),
        )
        for old, new, floor in counts:
            if (old is None) != (new is None):
                return True
            if old is not None and new is not None:
                change = abs(new - old)
                if change >= floor and change > self.relative * max(old, new):
                    return True
        for old, new in (
            (last.kv_cache, record.kv_cache),
            (last.prefix_hit_rate, record.prefix_hit_rate),
        ):
            if (old is None) != (new is None):
                return True
            if old is not None and new is not None and abs(new - old) > self.fraction:
                return True
        return False
