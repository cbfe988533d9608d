"""The simulated vLLM replicas over HTTP: prefix caching, metrics, ORCA headers, faults."""

from __future__ import annotations

import json

import httpx
import pytest
from harness.rig import BackendFactory
from harness.wait import wait_until

from bench.rig.loadgen import parse_metrics
from controlplane.local.replicas import BackendProcess
from replicasim.simulator import SimConfig

SYSTEM = "alpha beta gamma delta " * 100


def chat(url: str, question: str, *, stream: bool = False, **extra: object) -> httpx.Response:
    body = {
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "stream": stream,
        **extra,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


@pytest.fixture
def sim(backends: BackendFactory) -> BackendProcess:
    return backends(2, id_prefix="sim", simulator=SimConfig(orca=True, stream_interval=0.01))


def test_second_request_with_the_same_prefix_hits_the_cache(sim: BackendProcess) -> None:
    url = sim.replicas[0].url
    first = chat(url, "one").json()
    second = chat(url, "two").json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384
    assert second["usage"]["completion_tokens"] == 8
    metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert metrics["vllm:prefix_cache_hits_total"] >= 384
    assert metrics["vllm:prefix_cache_queries_total"] == 2 * first["usage"]["prompt_tokens"]
    assert metrics["vllm:time_to_first_token_seconds_count"] == 2
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert name in metrics


def test_stream_has_usage_and_orca_header(sim: BackendProcess) -> None:
    response = chat(sim.replicas[1].url, "hi", stream=True, stream_options={"include_usage": True})
    assert response.headers["x-backend-id"] == sim.replicas[1].id
    assert response.headers["endpoint-load-metrics"].startswith("TEXT cpu_utilization=")
    assert "named_metrics.kv_cache_usage_perc=" in response.headers["endpoint-load-metrics"]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 8
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_reset_forgets_the_cache_and_zeroes_counters(sim: BackendProcess) -> None:
    url = sim.replicas[0].url
    chat(url, "one")
    sim.reset()
    assert parse_metrics(httpx.get(f"{url}/metrics").text)["vllm:prefix_cache_queries_total"] == 0
    assert chat(url, "two").json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("status", [429, 503])
def test_fail_answers_with_the_status(sim: BackendProcess, status: int) -> None:
    sim.fail(sim.replicas[0].id, status)
    assert chat(sim.replicas[0].url, "x").status_code == status
    sim.fail(sim.replicas[0].id, 0)
    assert chat(sim.replicas[0].url, "x").status_code == 200


def test_die_stops_one_replica_and_the_other_goes_on(sim: BackendProcess) -> None:
    dead, alive = sim.replicas
    sim.die(dead.id)

    def refused() -> bool:
        try:
            httpx.get(f"{dead.url}/health", timeout=1)
        except httpx.HTTPError:
            return True
        return False

    wait_until(refused, 10)
    assert chat(alive.url, "still here").status_code == 200


def test_slow_makes_steps_slower(sim: BackendProcess) -> None:
    url = sim.replicas[0].url
    sim.slow(sim.replicas[0].id, 20)
    chat(url, "slow")
    busy = parse_metrics(httpx.get(f"{url}/metrics").text)["kvpilot_sim_busy_seconds_total"]
    # 8 steps of at least 20 x 12 ms.
    assert busy >= 8 * 20 * 0.012
