"""Metric maps and the Prometheus parser: what each server's /metrics becomes."""

from __future__ import annotations

import pytest

from signals.telemetry import (
    SGLANG,
    TGI,
    VLLM,
    Counters,
    MetricMap,
    TelemetryRecord,
    extract,
    metric_map_for,
    parse_samples,
)
from signals.writeband import WriteBand

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 5.0
vllm:num_requests_running{engine="1",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 2.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.61
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="llama"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 250.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="llama"} 120.0
vllm:iteration_tokens_total_count{engine="0",model_name="llama"} 120.0
vllm:iteration_tokens_total_sum{engine="0",model_name="llama"} 9000.0
vllm:iteration_tokens_total_count{engine="1",model_name="llama"} 80.0
"""

VLLM_V0 = """\
vllm:num_requests_running{model_name="llama"} 4.0
vllm:num_requests_waiting{model_name="llama"} 1.0
vllm:gpu_cache_usage_perc{model_name="llama"} 0.3
vllm:gpu_prefix_cache_queries_total{model_name="llama"} 10.0
vllm:gpu_prefix_cache_hits_total{model_name="llama"} 5.0
"""

SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen"} 3.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen"} 0.55
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="qwen"} 0.8
"""

TGI_TEXT = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 12
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 20480
"""


def test_parse_samples_keeps_every_series_and_drops_created() -> None:
    samples = parse_samples(VLLM_V1)
    assert samples["vllm:num_requests_running"] == [5.0, 3.0]
    assert "vllm:prefix_cache_queries_created" not in samples
    assert samples["vllm:prefix_cache_queries_total"] == [1000.0]


def test_parse_samples_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_samples("this is { not prometheus\n")


@pytest.mark.parametrize(
    ("text", "metric_map", "expected"),
    [
        pytest.param(
            VLLM_V1,
            VLLM,
            {
                "waiting": 2.0,
                "running": 8.0,
                "kv_cache": 0.61,
                "prefilled_tokens_total": 750.0,
                "steps_total": 200.0,
                "engines": 2,
            },
            id="vllm-v1: counts summed over engines (counted), KV cache is the fullest engine",
        ),
        pytest.param(
            VLLM_V0,
            VLLM,
            {"waiting": 1.0, "running": 4.0, "kv_cache": 0.3, "prefilled_tokens_total": 5.0},
            id="vllm-v0: the older gpu_cache_usage_perc name",
        ),
        pytest.param(
            SGLANG_TEXT,
            SGLANG,
            {"waiting": 3.0, "running": 7.0, "kv_cache": 0.55, "prefix_hit_rate": 0.8},
            id="sglang",
        ),
        pytest.param(
            TGI_TEXT,
            TGI,
            {"waiting": 6.0, "running": 12.0, "pending_tokens": 20480.0},
            id="tgi: no KV-cache gauge, pending tokens instead",
        ),
        pytest.param(
            "other_metric 1\n", VLLM, {}, id="a server that exports nothing known: all unset"
        ),
    ],
)
def test_builtin_maps(text: str, metric_map: MetricMap, expected: dict[str, float]) -> None:
    record, _ = extract(parse_samples(text), metric_map, at=100.0)
    got = record.model_dump(exclude_none=True, exclude={"at", "format"})
    assert got == pytest.approx(expected)


def test_prefix_hit_rate_comes_from_counter_deltas_between_scrapes() -> None:
    first, counters = extract(parse_samples(VLLM_V1), VLLM, at=1.0)
    assert first.prefix_hit_rate is None  # one sample of a counter is not a rate
    assert counters == Counters(queries=1000.0, hits=250.0, at=1.0)
    later = VLLM_V1.replace("} 1000.0", "} 1400.0").replace("} 250.0", "} 550.0")
    second, _ = extract(parse_samples(later), VLLM, at=2.0, previous=counters)
    assert second.prefix_hit_rate == pytest.approx(300 / 400)


def test_a_counter_reset_gives_no_rate() -> None:
    _, counters = extract(parse_samples(VLLM_V0), VLLM, at=1.0)
    restarted = VLLM_V0.replace('queries_total{model_name="llama"} 10.0', "queries_total 2.0")
    record, _ = extract(parse_samples(restarted), VLLM, at=2.0, previous=counters)
    assert record.prefix_hit_rate is None


def test_max_running_given_by_the_operator_when_the_server_does_not_export_it() -> None:
    record, _ = extract(parse_samples(VLLM_V0), VLLM, at=1.0, max_running=256)
    assert record.max_running == 256


def test_custom_map_from_yaml_like_mapping() -> None:
    custom = MetricMap.from_mapping(
        {
            "waiting": "queue_len",
            "running": ["busy", "active"],
            "kv_cache": "kv_pct",
            "kv_cache_scale": 0.01,
        }
    )
    record, _ = extract(
        parse_samples("queue_len 4\nactive 2\nkv_pct 87\n"), custom, at=1.0, format="custom"
    )
    assert (record.waiting, record.running, record.kv_cache) == (4.0, 2.0, pytest.approx(0.87))
    assert metric_map_for("custom", custom) is custom


@pytest.mark.parametrize(
    "data",
    [{"queue": "x"}, {"waiting": 3}, {"running": ["a", 1]}],
    ids=["unknown key", "not a name", "not a list of names"],
)
def test_custom_map_rejects_mistakes_with_a_sentence(data: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="metric map key"):
        MetricMap.from_mapping(data)


def test_metric_map_for_names_the_known_formats() -> None:
    assert metric_map_for("sglang") is SGLANG
    with pytest.raises(ValueError, match="vllm, sglang, tgi, custom"):
        metric_map_for("triton")
    with pytest.raises(ValueError, match="needs a metric map"):
        metric_map_for("custom")


def test_record_json_is_compact_and_round_trips() -> None:
    record = TelemetryRecord(at=12.5, waiting=3, kv_cache=0.5, format="vllm")
    text = record.to_json()
    assert "running" not in text
    assert TelemetryRecord.model_validate_json(text) == record
    # Fields a newer agent adds are ignored, not an error.
    assert TelemetryRecord.model_validate_json('{"at": 1, "gpu_temp": 80}').at == 1


def test_the_write_band_lets_noise_through_only_on_refresh() -> None:
    band = WriteBand()
    last = TelemetryRecord(at=0, waiting=40, running=10, kv_cache=0.5, pending_tokens=5000)

    def moved(**change: float | None) -> bool:
        return band.moved(last, last.model_copy(update=change))

    # Within the band: a few percent on a long queue, a wiggle of the KV cache.
    assert not moved(waiting=43, running=11, kv_cache=0.53, pending_tokens=5300, at=9)
    # Beyond it: the queue grows by a quarter, the cache fills, a signal appears or goes.
    assert moved(waiting=50)
    assert moved(kv_cache=0.6)
    assert moved(pending_tokens=None)
    assert moved(max_running=64)
    # A short queue counts every request.
    short = TelemetryRecord(at=0, waiting=0)
    assert band.moved(short, short.model_copy(update={"waiting": 1}))
    # Speed: a scrape's noise stays within the band, a slower replica does not.
    decoding = TelemetryRecord(at=0, time_per_output_token=0.03)
    assert not band.moved(decoding, decoding.model_copy(update={"time_per_output_token": 0.036}))
    assert band.moved(decoding, decoding.model_copy(update={"time_per_output_token": 0.045}))
    assert band.moved(decoding, decoding.model_copy(update={"time_per_output_token": None}))


def histogram(name: str, seconds: float, count: float) -> str:
    """A histogram with only its +Inf bucket, in Prometheus text: `count` observations that
    sum to `seconds`."""
    return (
        f"# TYPE {name} histogram\n"
        f'{name}_bucket{{le="+Inf"}} {count}\n'
        f"{name}_sum {seconds}\n"
        f"{name}_count {count}\n"
    )


def test_time_per_output_token_is_the_mean_between_scrapes() -> None:
    def scrape(seconds: float, tokens: float) -> str:
        return histogram("vllm:time_per_output_token_seconds", seconds, tokens)

    first, counters = extract(parse_samples(scrape(10.0, 500)), VLLM, at=1.0)
    assert first.time_per_output_token is None  # totals since start say nothing about now
    second, counters = extract(parse_samples(scrape(16.0, 600)), VLLM, at=2.0, previous=counters)
    assert second.time_per_output_token == pytest.approx(0.06)
    idle, _ = extract(parse_samples(scrape(16.0, 600)), VLLM, at=3.0, previous=counters)
    assert idle.time_per_output_token is None  # no token generated: no evidence


def test_output_tokens_per_second_are_the_tokens_made_between_scrapes_over_their_time() -> None:
    def scrape(tokens: float) -> str:
        return histogram("vllm:time_per_output_token_seconds", tokens * 0.025, tokens)

    first, counters = extract(parse_samples(scrape(500)), VLLM, at=1.0)
    assert first.output_tokens_per_second is None  # a total since start is no rate
    second, counters = extract(parse_samples(scrape(580)), VLLM, at=1.25, previous=counters)
    assert second.output_tokens_per_second == pytest.approx(320.0)
    # Idle: no token made, a rate of nothing (not unknown).
    idle, _ = extract(parse_samples(scrape(580)), VLLM, at=2.25, previous=counters)
    assert idle.output_tokens_per_second == 0.0
    # Each record also carries the total, from the first scrape on: two records read apart
    # give the rate between them, whatever was scraped in between.
    assert (first.output_tokens_total, second.output_tokens_total) == (500, 580)
    assert idle.output_tokens_total == 580


def test_prefill_per_token_is_the_uncached_prompt_tokens_per_output_token() -> None:
    def scrape(queries: float, hits: float, tokens: float) -> str:
        return (
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total {queries}\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total {hits}\n"
        ) + histogram("vllm:time_per_output_token_seconds", tokens * 0.02, tokens)

    first, counters = extract(parse_samples(scrape(1000, 800, 100)), VLLM, at=1.0)
    assert first.prefill_per_token is None  # totals since start say nothing about now
    # 5,000 prompt tokens asked, 1,000 found cached: 4,000 prefilled for 200 output tokens.
    burst, counters = extract(
        parse_samples(scrape(6000, 1800, 300)), VLLM, at=2.0, previous=counters
    )
    assert burst.prefill_per_token == pytest.approx(20.0)
    decoding, _ = extract(parse_samples(scrape(6000, 1800, 500)), VLLM, at=3.0, previous=counters)
    assert decoding.prefill_per_token == 0.0  # no prompt in the interval: all decode
    idle, _ = extract(parse_samples(scrape(6000, 1800, 300)), VLLM, at=3.0, previous=counters)
    assert idle.prefill_per_token is None  # no token generated: no evidence


def test_median_time_per_output_token_shrugs_off_a_few_long_prefill_steps() -> None:
    """Two engines of one replica (summed bucket by bucket), vLLM V1's histogram name. Between
    the scrapes 200 tokens came at about 14 ms and 16 in steps stalled by a long prefill
    (0.256 s): the mean nearly doubles, the median stays in the first bucket of note."""

    def scrape(fast: int, slow: int, seconds: float) -> str:
        name = "vllm:inter_token_latency_seconds"
        lines = [f"# TYPE {name} histogram"]
        for engine, share in (("0", 0.5), ("1", 0.5)):
            counts = {"0.01": 0, "0.025": fast, "0.05": fast, "0.3": fast + slow}
            counts = {bound: int(value * share) for bound, value in counts.items()}
            labels = f'engine="{engine}"'
            lines += [f'{name}_bucket{{{labels},le="{b}"}} {c}' for b, c in counts.items()]
            lines += [
                f'{name}_bucket{{{labels},le="+Inf"}} {int((fast + slow) * share)}',
                f"{name}_sum{{{labels}}} {seconds * share}",
                f"{name}_count{{{labels}}} {int((fast + slow) * share)}",
            ]
        return "\n".join(lines) + "\n"

    _, counters = extract(parse_samples(scrape(1000, 20, 19.1)), VLLM, at=1.0)
    record, counters = extract(
        parse_samples(scrape(1200, 36, 19.1 + 200 * 0.014 + 16 * 0.256)),
        VLLM,
        at=2.0,
        previous=counters,
    )
    assert record.time_per_output_token == pytest.approx((200 * 0.014 + 16 * 0.256) / 216)
    # Rank 108 of 216, all of the first 200 within (0.01, 0.025]: 0.01 + 0.015 * 108 / 200.
    assert record.median_time_per_output_token == pytest.approx(0.0181)
    few, _ = extract(
        parse_samples(scrape(1206, 36, 19.1 + 206 * 0.014 + 16 * 0.256)),
        VLLM,
        at=3.0,
        previous=counters,
    )
    assert few.median_time_per_output_token is None  # 6 tokens: too few to tell
    assert few.time_per_output_token == pytest.approx(0.014)
    restarted, _ = extract(parse_samples(scrape(10, 0, 0.14)), VLLM, at=4.0, previous=counters)
    assert restarted.median_time_per_output_token is None


def test_a_move_of_the_median_is_written_its_coming_and_going_is_not() -> None:
    band = WriteBand()
    record = TelemetryRecord(at=0, time_per_output_token=0.03, median_time_per_output_token=0.018)
    assert band.speed_moved(
        record, record.model_copy(update={"median_time_per_output_token": 0.04})
    )
    assert not band.speed_moved(
        record, record.model_copy(update={"median_time_per_output_token": 0.02})
    )
    assert not band.speed_moved(
        record, record.model_copy(update={"median_time_per_output_token": None})
    )


def test_time_to_first_token_is_the_mean_since_the_last_first_token_while_the_replica_works() -> (
    None
):
    def scrape(seconds: float, count: float, running: int) -> str:
        counts = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n"
        return counts + histogram("vllm:time_to_first_token_seconds", seconds, count)

    first, counters = extract(parse_samples(scrape(50.0, 100, 4)), VLLM, at=1.0)
    assert first.ttft is None  # totals since start say nothing about now
    second, counters = extract(parse_samples(scrape(53.0, 104, 4)), VLLM, at=2.0, previous=counters)
    assert second.ttft == pytest.approx(0.75)
    # No first token since: the last mean is carried while the replica works, and the
    # window grows until the next first token comes.
    waiting, counters = extract(
        parse_samples(scrape(53.0, 104, 6)), VLLM, at=3.0, previous=counters
    )
    assert waiting.ttft == pytest.approx(0.75)
    later, counters = extract(parse_samples(scrape(55.0, 105, 6)), VLLM, at=4.0, previous=counters)
    assert later.ttft == pytest.approx(2.0)
    # Idle: nothing to speak of, so a pool does not stay saturated on an old burst.
    idle, _ = extract(parse_samples(scrape(55.0, 105, 0)), VLLM, at=5.0, previous=counters)
    assert idle.ttft is None
    band = WriteBand()
    assert band.moved(second, later)
    assert not band.moved(second, second.model_copy(update={"ttft": 0.76}))
