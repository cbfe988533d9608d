"""Virtual models in tests: a policy with a small and a large target model and the requests
that tell them apart (an easy prompt, a hard one)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from harness.builders import policy, pool, route
from harness.rig import Rig

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
