"""A virtual model over three target models through a real Envoy: each request goes to the
target whose band its score falls in, with the body's ``model`` rewritten and the answering
model named; with shares, kvpilot moves each target's threshold so each keeps its share."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from harness.difficulty import EASY, TARGETS, answered_by, post, targets_policy
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


def answered(client: httpx.Client, url: str, scores: list[float], blocks: int = 1) -> Counter[str]:
    """Which model answered requests with these stated scores, `blocks` times over."""
    out: Counter[str] = Counter()
    for _ in range(blocks):
        for value in scores:
            reply = post(client, url, EASY, **{"x-kvpilot-difficulty": f"{value}"})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == reply.headers["x-kvpilot-model"]
            out[reply.headers["x-kvpilot-model"]] += 1
    return out


def start(rig: Rig, backends: BackendFactory, **virtual: object) -> tuple[httpx.Client, str]:
    replicas = [backends(1, id_prefix=model.removeprefix("llama-")[:2]) for model in TARGETS]
    targets = virtual.pop("targets")
    assert isinstance(targets, list)
    targets_policy(rig, [ports_of(r) for r in replicas], targets, **virtual)
    client, url = httpx.Client(timeout=10), rig.url()
    wait_until(lambda: answered_by(client, url, EASY, TARGETS), 30, message="the virtual model")
    return client, url


def test_each_score_band_goes_to_its_target(rig: Rig, backends: BackendFactory) -> None:
    client, url = start(
        rig,
        backends,
        targets=[{}, {"threshold": 0.4}, {"threshold": 0.8}],
        share=None,
        scorer={"type": "header"},
    )
    assert answered(client, url, [0.1, 0.4]) == {"llama-small": 2}
    assert answered(client, url, [0.41, 0.6, 0.8]) == {"llama-medium": 3}
    assert answered(client, url, [0.81, 1.0]) == {"llama-large": 2}
    reply = post(client, url, EASY, **{"x-kvpilot-difficulty": "hard"})
    assert reply.headers["x-backend-id"].startswith("la")
    # Streaming to the target in the middle: every chunk names it.
    with client.stream(
        "POST",
        url,
        content=json.dumps({**EASY, "stream": True}).encode(),
        headers={"x-kvpilot-difficulty": "0.5"},
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["x-kvpilot-model"] == "llama-medium"
        events = [
            json.loads(line[len("data: ") :])
            for line in stream.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert events and {event["model"] for event in events} == {"llama-medium"}

    def view() -> dict[str, Any]:
        (entry,) = rig.api.get("/v1/virtualmodels").json()["virtualModels"]
        return dict(entry)

    wait_until(
        lambda: view()["targets"].get("llama-medium") == 4, 10, message="the scores reported"
    )
    assert [(t["model"], t["threshold"]) for t in view()["targetModels"]] == [
        ("llama-small", None),
        ("llama-medium", 0.4),
        ("llama-large", 0.8),
    ]


SPREAD = [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95]
"""A block of ten requests with scores spread evenly: shares of 20% for the medium model and
10% for the large one need thresholds between 0.65 and 0.75, and 0.85 and 0.95."""


def test_kvpilot_holds_each_targets_share(rig: Rig, backends: BackendFactory) -> None:
    client, url = start(
        rig,
        backends,
        targets=[{}, {"share": 20, "threshold": 0.3}, {"share": 10, "threshold": 0.5}],
        scorer={"type": "header"},
    )
    # The configured thresholds send 7 in 10 above the first target (the cap, 40%, holds
    # less); kvpilot learns the scores and moves both thresholds. A score tied at a threshold
    # passes it with a probability, so a block's split varies by a request or so.
    wanted = {"llama-small": 70, "llama-medium": 20, "llama-large": 10}

    def near(counts: Counter[str], blocks: int, points: float) -> bool:
        return all(abs(100 * counts[m] / (10 * blocks) - wanted[m]) <= points for m in wanted)

    wait_until(
        lambda: near(answered(client, url, SPREAD, 5), 5, 2),
        90,
        message="70/20/10 across the three targets",
    )
    held = answered(client, url, SPREAD, 20)
    assert near(held, 20, 3), held
    thresholds = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in rig.api.get("/metrics").text.splitlines()
        if line.startswith("kvpilot_virtual_model_threshold{")
    }
    assert 0.65 <= thresholds["main/llama-auto@llama-medium"] <= 0.75, thresholds
    assert 0.85 <= thresholds["main/llama-auto"] <= 0.95, thresholds
