"""The official `openai` Python SDK through Envoy, as real clients use kvpilot.

Listing models (answered by Envoy from config), chat completions plain and streamed, routing
by the `model` field, session affinity, and Envoy's own 429 and 404 in the forms the SDK
turns into its typed errors.
"""

from __future__ import annotations

import collections
from typing import Any

import openai
import pytest
from harness.builders import FAST_HEALTH_CHECK, policy, pool
from harness.rig import Rig
from harness.wait import wait_until

pytestmark = pytest.mark.e2e

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def test_the_openai_sdk_lists_models_routes_streams_sticks_and_sees_429(
    rig: Rig, backends: Any
) -> None:
    llama = backends(3, id_prefix="llama", model="llama-3")
    qwen = backends(1, id_prefix="qwen", model="qwen-7b")
    llama_ports = [r.port for r in llama.replicas]
    qwen_ports = [r.port for r in qwen.replicas]
    rig.apply(
        pool("llama", llama_ports, models=["llama-3"], health_check=FAST_HEALTH_CHECK),
        pool(
            "qwen",
            qwen_ports,
            models=["qwen-7b", "qwen-7b-instruct"],
            health_check=FAST_HEALTH_CHECK,
        ),
        policy(
            "chat",
            rig.listener_port,
            [
                {
                    "name": "llama",
                    "match": {"models": ["llama-3"]},
                    "sessionAffinity": {},
                    "tiers": [["llama"]],
                },
                {
                    "name": "qwen",
                    "match": {"models": ["qwen-7b"]},
                    "tiers": [["qwen"]],
                    "rateLimit": {"requests": 4, "unit": "hour"},
                },
            ],
        ),
    )
    rig.wait_ready("chat/llama/affinity", llama_ports)
    rig.wait_ready("chat/qwen", qwen_ports)
    client = openai.OpenAI(base_url=rig.url("/v1"), api_key="not-checked", max_retries=0)

    # What chat UIs do first. Envoy answers from config: no replica is asked.
    models = wait_until(lambda: client.models.list().data, 30, message="GET /v1/models")
    assert [(m.id, m.object, m.owned_by) for m in models] == [
        ("llama-3", "model", "kvpilot"),
        ("qwen-7b", "model", "kvpilot"),
    ]
    raw = client.models.with_raw_response.list()
    assert raw.headers.get("x-backend-id") is None
    assert raw.headers["content-type"] == "application/json"

    # Plain completions, routed by model, each session sticking to one replica.
    landed: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for turn in range(3):
        for session in [f"s-{i}" for i in range(8)]:
            response = client.chat.completions.with_raw_response.create(
                model="llama-3",
                messages=MESSAGES,
                extra_headers={"x-session-id": session},
            )
            completion = response.parse()
            backend = response.headers["x-backend-id"]
            assert backend.startswith("llama-"), backend
            assert completion.choices[0].message.content == f"Hello from {backend}.", turn
            landed[session][backend] += 1
    assert all(len(counter) == 1 for counter in landed.values()), landed
    assert len({next(iter(c)) for c in landed.values()}) > 1, "sessions spread over replicas"

    # Streaming, as the SDK parses it: chunks add up to the replica's answer.
    stream = client.chat.completions.create(model="qwen-7b", messages=MESSAGES, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "Hello from qwen-0."

    # The qwen route allows 4 requests an hour: the stream spent one. Envoy's 429 comes in
    # OpenAI's error format, which the SDK raises as RateLimitError.
    for _ in range(3):
        client.chat.completions.create(model="qwen-7b", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="qwen-7b", messages=MESSAGES)
    assert limited.value.status_code == 429
    assert limited.value.code == "rate_limit_exceeded"
    assert limited.value.response.headers.get("x-backend-id") is None

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert unknown.value.code == "model_not_found"
