"""Virtual models in tests: a policy with a small and a large target model and the requests
that tell them apart (an easy prompt, a hard one)."""

from __future__ import annotations

import json
from collections.abc import Iterable
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


def virtual_policy(
    rig: Rig,
    small: list[int],
    large: list[int],
    *,
    prices: tuple[dict[str, Any], dict[str, Any]] | None = None,
    **virtual: Any,
) -> None:
    """Pools ``small`` and ``large`` (priced with ``prices``, small's then large's, when
    given) and policy ``main`` with the virtual model ``llama-auto`` over them."""
    priced: tuple[dict[str, Any], dict[str, Any]] = (
        ({"price": prices[0]}, {"price": prices[1]}) if prices is not None else ({}, {})
    )
    rig.apply(
        pool("small", small, models=["llama-small"], **priced[0]),
        pool("large", large, models=["llama-large"], **priced[1]),
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


def answered_by(
    client: httpx.Client, url: str, body: dict[str, Any], models: Iterable[str]
) -> bool:
    """Whether one of `models` answered `body`. The virtual host names the chosen model on
    Envoy's own replies too (a 503 when the chosen target has no healthy replica), so a wait
    for the virtual model to route reads the status as well as the header."""
    reply = post(client, url, body)
    return reply.status_code == 200 and reply.headers.get("x-kvpilot-model") in set(models)


TARGETS = ("llama-small", "llama-medium", "llama-large")


def targets_policy(
    rig: Rig, ports: list[list[int]], targets: list[dict[str, Any]], **virtual: Any
) -> None:
    """A pool and a route per model of ``TARGETS`` (replicas at ``ports``, in the same order)
    and the virtual model ``llama-auto`` over them, ``targets`` giving each target's fields
    beyond its model."""
    rig.apply(
        *(
            pool(model.removeprefix("llama-"), model_ports, models=[model])
            for model, model_ports in zip(TARGETS, ports, strict=True)
        )
    )
    document = policy(
        "main",
        rig.listener_port,
        [
            route(
                model.removeprefix("llama-"),
                name=model.removeprefix("llama-"),
                match={"models": [model]},
            )
            for model in TARGETS
        ],
    )
    document["spec"]["virtualModels"] = [
        {
            "name": "llama-auto",
            "targets": [
                {"model": model, **fields} for model, fields in zip(TARGETS, targets, strict=True)
            ],
            **virtual,
        }
    ]
    rig.apply(document)
