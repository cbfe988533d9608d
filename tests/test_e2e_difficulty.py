"""Virtual models through a real Envoy: one model name, a small and a large target, chosen per
request by Envoy's Lua scorer; the body's ``model`` rewritten, the answering model named."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from harness.builders import policy, pool, route
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until

from policies.difficulty import score
from policies.models import DEFAULT_BIAS, DEFAULT_WEIGHTS

pytestmark = pytest.mark.e2e

EASY = {"model": "llama-auto", "messages": [{"role": "user", "content": "Hi! What is 2+2?"}]}
HARD_TEXT = (
    "Explain why this Rust program deadlocks, how to design a lock-free version, and compare "
    "the two for throughput. Derive the amortized complexity of each operation.\n"
    "```rust\n" + "fn step(state: &Mutex<State>) { let guard = state.lock(); }\n" * 40 + "```\n"
    "```rust\n" + "let x = y * 2 + z;\n" * 20 + "```\n"
)
HARD = {
    "model": "llama-auto",
    "max_tokens": 4096,
    "reasoning_effort": "high",
    "messages": [
        {"role": "system", "content": "You are a senior engineer."},
        {"role": "user", "content": HARD_TEXT},
    ],
}


def virtual_policy(rig: Rig, small: list[int], large: list[int], **virtual: Any) -> None:
    rig.apply(
        pool("small", small, models=["llama-small"]),
        pool("large", large, models=["llama-large"]),
    )
    document = policy(
        "main",
        rig.listener_port,
        [
            route("small", name="small", match={"models": ["llama-small"]}),
            route("large", name="large", match={"models": ["llama-large"]}),
        ],
    )
    document["spec"]["virtualModels"] = [
        {"name": "llama-auto", "small": "llama-small", "large": "llama-large", **virtual}
    ]
    rig.apply(document)


def post(client: httpx.Client, url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return client.post(url, content=json.dumps(body).encode(), headers=headers)


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
