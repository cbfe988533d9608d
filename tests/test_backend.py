"""The simulated OpenAI-compatible backend replicas."""

from __future__ import annotations

import json

import httpx
import pytest
from harness.processes import process_gone
from harness.rig import BackendFactory
from harness.wait import wait_until

from controlplane.local.replicas import BackendProcess
from replicasim.server import parse_ports

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def two(backends: BackendFactory) -> BackendProcess:
    return backends(2, id_prefix="be")


def test_each_replica_answers_a_chat_completion_with_its_identity(two: BackendProcess) -> None:
    assert [r.id for r in two.replicas] == ["be-0", "be-1"]
    assert len({r.port for r in two.replicas}) == 2
    for replica in two.replicas:
        response = httpx.post(f"{replica.url}/v1/chat/completions", json=CHAT, timeout=5)
        assert response.status_code == 200
        assert response.headers["x-backend-id"] == replica.id
        body = response.json()
        assert body["backend"] == replica.id
        assert body["object"] == "chat.completion"
        assert body["model"] == "sim-model"
        assert replica.id in body["choices"][0]["message"]["content"]


def test_text_completion_is_openai_shaped(two: BackendProcess) -> None:
    replica = two.replica("be-1")
    response = httpx.post(f"{replica.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
    body = response.json()
    assert body["object"] == "text_completion"
    assert "be-1" in body["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_returns_sse_chunks_ending_in_done(two: BackendProcess, path: str) -> None:
    replica = two.replicas[0]
    with httpx.stream(
        "POST", f"{replica.url}{path}", json={**CHAT, "stream": True}, timeout=5
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-backend-id"] == replica.id
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert {c["backend"] for c in chunks} == {replica.id}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    field = "delta" if "chat" in path else "text"
    pieces = [c["choices"][0][field] for c in chunks]
    text = "".join(p.get("content", "") if isinstance(p, dict) else p for p in pieces)
    assert text == f"Hello from {replica.id}."


def test_admin_fail_makes_the_replica_fail_until_recovered(two: BackendProcess) -> None:
    failing, other = two.replicas
    two.fail(failing.id, 503)
    response = httpx.post(f"{failing.url}/v1/chat/completions", json=CHAT, timeout=5)
    assert response.status_code == 503
    assert response.headers["x-backend-id"] == failing.id
    assert httpx.post(f"{other.url}/v1/chat/completions", json=CHAT, timeout=5).status_code == 200
    two.fail(failing.id, 0)
    assert httpx.post(f"{failing.url}/v1/chat/completions", json=CHAT, timeout=5).status_code == 200


def test_health_follows_admin_health(two: BackendProcess) -> None:
    replica = two.replicas[0]
    assert httpx.get(f"{replica.url}/health", timeout=5).status_code == 200
    two.set_healthy(replica.id, False)
    assert httpx.get(f"{replica.url}/health", timeout=5).status_code == 503
    two.set_healthy(replica.id, True)
    assert httpx.get(f"{replica.url}/health", timeout=5).status_code == 200


def test_metrics_expose_vllm_gauges_and_request_counters(two: BackendProcess) -> None:
    replica = two.replicas[0]
    httpx.post(f"{replica.url}/v1/chat/completions", json=CHAT, timeout=5)
    text = httpx.get(f"{replica.url}/metrics", timeout=5).text
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert f"# TYPE {gauge} gauge" in text
        assert f'{gauge}{{model_name="sim-model"}} ' in text
    assert (
        'kvpilot_backend_requests_total{backend="be-0",path="/v1/chat/completions",status="200"} 1'
        in text
    )


def test_bad_json_is_a_400(two: BackendProcess) -> None:
    response = httpx.post(f"{two.replicas[0].url}/v1/chat/completions", content=b"{nope", timeout=5)
    assert response.status_code == 400


def test_stop_ends_the_process(backends: BackendFactory) -> None:
    process = backends(1, id_prefix="solo")
    pid = process.pid
    assert pid is not None
    process.stop()
    wait_until(lambda: process_gone(pid), timeout=5, message="backend still running")


@pytest.mark.parametrize(
    ("text", "replicas", "expected"),
    [("0", 3, [0, 0, 0]), ("8001,8002", 2, [8001, 8002])],
)
def test_ports_argument(text: str, replicas: int, expected: list[int]) -> None:
    assert parse_ports(text, replicas) == expected


def test_ports_argument_must_match_replica_count() -> None:
    with pytest.raises(ValueError, match="2 ports for 3 replicas"):
        parse_ports("1,2", 3)
