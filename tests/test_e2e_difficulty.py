"""Virtual models through a real Envoy: one model name, a small and a large target, chosen per
request by Envoy's Lua scorer; the body's ``model`` rewritten, the answering model named."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from harness.difficulty import EASY, HARD, answered_by, post, virtual_policy
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until

from policies.models import DEFAULT_BIAS, DEFAULT_WEIGHTS
from signals.difficulty import score

pytestmark = pytest.mark.e2e


def test_a_virtual_model_sends_easy_prompts_to_the_small_model_and_hard_ones_to_the_large(
    rig: Rig, backends: BackendFactory
) -> None:
    small, large = backends(1, id_prefix="sm"), backends(1, id_prefix="lg")
    virtual_policy(rig, ports_of(small), ports_of(large), share=None, threshold=0.5)
    url = rig.url()
    client = httpx.Client(timeout=10)
    wait_until(lambda: post(client, url, EASY).status_code == 200, 30, message="the virtual model")

    easy = post(client, url, EASY)
    assert easy.status_code == 200, easy.text
    assert easy.headers["x-backend-id"].startswith("sm")
    # The replica echoes the model it was asked for: the body reached it rewritten.
    assert easy.json()["model"] == "llama-small"
    assert easy.headers["x-kvpilot-model"] == "llama-small"

    hard = post(client, url, HARD)
    assert hard.status_code == 200, hard.text
    assert hard.headers["x-backend-id"].startswith("lg")
    assert hard.json()["model"] == "llama-large"
    assert hard.headers["x-kvpilot-model"] == "llama-large"

    # Envoy's score is the Python scorer's, to the four decimals it reports.
    for body in (EASY, HARD):
        reply = post(client, url, body)
        expected = score(DEFAULT_WEIGHTS, DEFAULT_BIAS, json.dumps(body).encode())
        assert float(reply.headers["x-kvpilot-difficulty-score"]) == pytest.approx(
            expected, abs=1e-4
        )

    # Streaming: the chunks flow, each names the large model, the header says so too.
    with client.stream(
        "POST", url, content=json.dumps({**HARD, "stream": True}).encode()
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["x-kvpilot-model"] == "llama-large"
        events = [
            json.loads(line[len("data: ") :])
            for line in stream.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert len(events) > 1
    assert {event["model"] for event in events} == {"llama-large"}

    # A client that knows says so.
    stated = post(client, url, EASY, **{"x-kvpilot-difficulty": "hard"})
    assert stated.headers["x-backend-id"].startswith("lg")

    # A target's own name still works, and is not labelled as a virtual model's answer.
    direct = post(client, url, {**EASY, "model": "llama-small"})
    assert direct.headers["x-backend-id"].startswith("sm")
    assert "x-kvpilot-model" not in direct.headers
    models = client.get(rig.url("/v1/models")).json()
    assert {"llama-auto", "llama-small", "llama-large"} <= {m["id"] for m in models["data"]}


CALM = [0.9, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05]
"""Scores of a block of ten requests with one hard prompt: a 20% share needs a threshold
between 0.4 and 0.45."""
BUSY = [0.9, 0.85, 0.8, 0.75, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05]
"""Four hard prompts in ten: the threshold must move up to between 0.8 and 0.85."""


def large_share(client: httpx.Client, url: str, scores: list[float], blocks: int) -> float:
    """Percent of `blocks` blocks of requests with these stated scores that the large model
    took."""
    large = 0
    for _ in range(blocks):
        for value in scores:
            reply = post(client, url, EASY, **{"x-kvpilot-difficulty": f"{value}"})
            assert reply.status_code == 200, reply.text
            large += reply.headers["x-kvpilot-model"] == "llama-large"
    return 100 * large / (blocks * len(scores))


def test_kvpilot_moves_the_threshold_so_the_large_share_holds_when_the_mix_changes(
    rig: Rig, backends: BackendFactory
) -> None:
    small, large = backends(1, id_prefix="sm"), backends(1, id_prefix="lg")
    virtual_policy(rig, ports_of(small), ports_of(large), share=20, scorer={"type": "header"})
    url = rig.url()
    client = httpx.Client(timeout=10)
    wait_until(lambda: post(client, url, EASY).status_code == 200, 30, message="the virtual model")
    # With the configured threshold (0.5) one request in ten goes large; kvpilot learns the
    # scores and moves the threshold until two in ten do.
    wait_until(
        lambda: large_share(client, url, CALM, 5) == 20,
        60,
        message="the calm mix to reach a 20% large share",
    )
    assert abs(large_share(client, url, CALM, 20) - 20) <= 3
    # Four hard prompts in ten: the threshold moves up.
    started = time.monotonic()
    wait_until(
        lambda: large_share(client, url, BUSY, 5) == 20,
        60,
        message="the busy mix to get back to a 20% large share",
    )
    print(f"busy mix back at a 20% large share after {time.monotonic() - started:.1f} s")
    assert abs(large_share(client, url, BUSY, 20) - 20) <= 3
    # Any threshold from 0.8 (ties going large with probability 0) to 0.85 (ties always
    # large) sends two in ten large: which one the window's quantile lands on depends on which
    # requests of the calm mix are still in it, so the test takes the whole interval.
    metrics = rig.api.get("/metrics").text
    (line,) = [
        line
        for line in metrics.splitlines()
        if line.startswith('kvpilot_virtual_model_threshold{virtual_model="main/llama-auto"}')
    ]
    assert 0.8 <= float(line.rsplit(" ", 1)[1]) <= 0.85, line
    assert "kvpilot_virtual_model_requests_total" in metrics
    # The console's view: the threshold in force and what Envoys reported.
    (view,) = rig.api.get("/v1/virtualmodels").json()["virtualModels"]
    assert (view["key"], view["share"]) == ("main/llama-auto", 20)
    assert 0.8 <= view["threshold"] <= 0.85, view
    assert view["targets"]["llama-large"] > 0 and view["targets"]["llama-small"] > 0
    assert view["sources"] == {"header": view["requests"]}
    assert sum(view["scores"]) == view["requests"]


def test_a_request_the_small_model_fails_is_answered_by_the_large_one(
    rig: Rig, backends: BackendFactory
) -> None:
    small, large = backends(1, id_prefix="sm"), backends(1, id_prefix="lg")
    virtual_policy(
        rig,
        ports_of(small),
        ports_of(large),
        share=None,
        threshold=0.5,
        escalation={"retryOn": ["5xx"]},
    )
    url = rig.url()
    client = httpx.Client(timeout=10)
    wait_until(
        lambda: answered_by(client, url, EASY, ["llama-small"]),
        30,
        message="the virtual model with escalation",
    )
    healthy = post(client, url, EASY)
    assert healthy.headers["x-backend-id"].startswith("sm")
    assert "x-kvpilot-escalated" not in healthy.headers

    port = ports_of(small)[0]
    httpx.post(f"http://127.0.0.1:{port}/admin/fail", json={"status": 503}).raise_for_status()
    for _ in range(3):
        escalated = post(client, url, EASY)
        assert escalated.status_code == 200, escalated.text
        assert escalated.headers["x-backend-id"].startswith("lg")
        # The large model got its own name in the body, and the client is told.
        assert escalated.json()["model"] == "llama-large"
        assert escalated.headers["x-kvpilot-model"] == "llama-large"
        assert escalated.headers["x-kvpilot-escalated"] == "true"
    # Streaming escalates the same way (the failure comes before the first byte).
    with client.stream(
        "POST", url, content=json.dumps({**EASY, "stream": True}).encode()
    ) as stream:
        assert stream.status_code == 200
        lines = list(stream.iter_lines())
        assert stream.headers["x-kvpilot-model"] == "llama-large", (stream.headers, lines[:3])
        assert any('"llama-large"' in line for line in lines)
    # A direct request for the small model is not escalated: only the virtual model's are.
    assert post(client, url, {**EASY, "model": "llama-small"}).status_code == 503
    wait_until(
        lambda: "kvpilot_virtual_model_escalations_total" in rig.api.get("/metrics").text,
        10,
        message="escalations reported",
    )
