"""The spend a virtual model saved, through a real Envoy with priced pools: the usage of each
response the small model served, priced at the large model's price less its own, is what
``GET /v1/virtualmodels``, the console and Prometheus report, to the last decimal; requests that named a
target themselves do not count; pools priced in different currencies state no saving."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

import httpx
import pytest
from harness.auth import READ_TOKEN
from harness.builders import pool
from harness.console import open_console, shoot
from harness.difficulty import EASY, HARD, post, virtual_policy
from harness.rig import BackendFactory, Rig, ports_of
from harness.spend import FAST_SIM
from harness.wait import wait_until

pytestmark = pytest.mark.e2e

SMALL_PRICE = {"currency": "USD", "input": "0.15", "cachedInput": "0.075", "output": "0.60"}
LARGE_PRICE = {"currency": "USD", "input": "2.50", "cachedInput": "1.25", "output": "10"}


def cost(usage: dict[str, Any], price: dict[str, str]) -> Decimal:
    """One response's cost at ``price``, per million tokens, as docs/cost.md states it."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (
        (prompt - cached) * Decimal(price["input"])
        + cached * Decimal(price["cachedInput"])
        + completion * Decimal(price["output"])
    ) / Decimal(1_000_000)


def usage_of(reply: httpx.Response) -> dict[str, Any]:
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [
            json.loads(line[len("data: ") :])
            for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        found = [event["usage"] for event in events if event.get("usage")]
        assert len(found) == 1, reply.text
        (usage,) = found
        return dict(usage)
    return dict(reply.json()["usage"])


def view(rig: Rig) -> dict[str, Any]:
    (entry,) = rig.api.get("/v1/virtualmodels").json()["virtualModels"]
    return dict(entry)


def test_the_spend_saved_is_the_small_models_tokens_at_the_price_difference(
    rig: Rig, backends: BackendFactory, browser: Any
) -> None:
    # Simulated vLLM replicas: usage in every answer, streams included, and a prefix cache.
    small = backends(1, id_prefix="sm", model="llama-small", simulator=FAST_SIM)
    large = backends(1, id_prefix="lg", model="llama-large", simulator=FAST_SIM)
    virtual_policy(
        rig,
        ports_of(small),
        ports_of(large),
        prices=(SMALL_PRICE, LARGE_PRICE),
        share=None,
        threshold=0.5,
    )
    url = rig.url()
    client = httpx.Client(timeout=10)
    # Requests that name a target themselves: counted as spend, not as the virtual model's.
    for model in ("llama-small", "llama-large"):
        wait_until(
            lambda model=model: (
                post(client, url, {**EASY, "model": model, "max_tokens": 8}).status_code == 200
            ),
            30,
            message=f"the route of {model}",
        )

    served: list[tuple[str, dict[str, Any]]] = []
    # Short answers; the client's header states the difficulty (the scorer is not under test).
    easy, hard = {**EASY, "max_tokens": 8}, {**HARD, "max_tokens": 8}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    bodies = [easy] * 6 + [hard] * 3 + [{**hard, **streamed}, {**easy, **streamed}]
    for body in bodies:
        difficulty = "hard" if body["messages"] == HARD["messages"] else "easy"
        reply = post(client, url, body, **{"x-kvpilot-difficulty": difficulty})
        assert reply.status_code == 200, reply.text
        served.append((reply.headers["x-kvpilot-model"], usage_of(reply)))
    assert {model for model, _ in served} == {"llama-small", "llama-large"}, served

    price = {"llama-small": SMALL_PRICE, "llama-large": LARGE_PRICE}
    spent = sum((cost(usage, price[model]) for model, usage in served), Decimal(0))
    at_large = sum((cost(usage, LARGE_PRICE) for _, usage in served), Decimal(0))
    saved = at_large - spent
    assert saved > 0
    # The repeated easy prompt came from the prefix cache: the cached price was used too.
    assert any((u.get("prompt_tokens_details") or {}).get("cached_tokens") for _, u in served)

    wait_until(
        lambda: (view(rig)["spend"] or {}).get("requests") == len(bodies),
        30,
        message="kvpilot to count the virtual model's responses",
    )
    spend = view(rig)["spend"]
    tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for _, u in served)
    assert spend["tokens"] == tokens
    assert spend["currency"] == "USD"
    assert Decimal(spend["cost"]) == spent
    assert Decimal(spend["largeCost"]) == at_large
    assert Decimal(spend["saved"]) == saved
    assert spend["reason"] is None

    metrics = rig.api.get("/metrics").text
    found = re.search(
        r'^kvpilot_virtual_model_spend_saved\{currency="USD",virtual_model="main/llama-auto"\} '
        r"(\S+)$",
        metrics,
        re.MULTILINE,
    )
    assert found is not None, metrics
    assert float(found.group(1)) == pytest.approx(float(saved), rel=1e-9)

    # The console's Virtual models tab shows the same figures.
    page = open_console(browser, rig.kvpilot.api_url, READ_TOKEN, "virtual")
    try:
        saved_text = page.locator('[data-virtual="main/llama-auto"] [data-saved]')
        saved_text.wait_for(timeout=10_000)
        assert saved_text.inner_text() == f"{spend['saved']} USD"
        shoot(page, "virtual-models-spend")
    finally:
        page.close()

    # The large model priced in another currency: no saving is stated, and the view says why.
    rig.apply(
        pool(
            "large",
            ports_of(large),
            models=["llama-large"],
            price={**LARGE_PRICE, "currency": "EUR"},
        )
    )
    wait_until(
        lambda: view(rig)["spend"]["saved"] is None,
        30,
        message="the saving to be withdrawn",
    )
    spend = view(rig)["spend"]
    assert "never converted" in spend["reason"], spend
    assert spend["requests"] == len(bodies)
    assert "kvpilot_virtual_model_spend_saved{" not in rig.api.get("/metrics").text
