"""A virtual model scored by the operator's classifier, through a real Envoy: its verdicts
route requests; when it is down or slower than its timeout every request goes to the
fallback target and none fails; the cap holds whatever it says."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest
from harness.difficulty import EASY, HARD, answered_by, post, virtual_policy
from harness.jsonserver import json_server
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until

from controlplane.local.process import free_port

pytestmark = pytest.mark.e2e


class Classifier:
    """A stand-in for the operator's classifier: hard when the prompt says so, or whatever
    ``verdict`` forces; ``delay`` seconds before it answers."""

    def __init__(self) -> None:
        self.verdict: float | None = None
        self.delay = 0.0
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, request: BaseHTTPRequestHandler) -> tuple[Any, dict[str, str]]:
        length = int(request.headers.get("content-length") or 0)
        body = request.rfile.read(length)
        with self.lock:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.verdict is not None:
            return {"score": self.verdict}, {}
        return {"score": 0.95 if b"deadlocks" in body else 0.05}, {}


def external(port: int, **fields: Any) -> dict[str, Any]:
    return {"type": "external", "external": {"url": f"http://127.0.0.1:{port}/score", **fields}}


def targets(client: httpx.Client, url: str, body: dict[str, Any], n: int) -> Counter[str]:
    """Which model answered each of `n` requests; a failed request counts as its status."""
    out: Counter[str] = Counter()
    for _ in range(n):
        reply = post(client, url, body)
        out[
            reply.headers.get("x-kvpilot-model", "")
            if reply.status_code == 200
            else str(reply.status_code)
        ] += 1
    return out


def test_the_classifier_routes_and_a_slow_or_dead_one_sends_everything_to_the_fallback(
    rig: Rig, backends: BackendFactory
) -> None:
    small, large = backends(1, id_prefix="sm"), backends(1, id_prefix="lg")
    classifier = Classifier()
    with json_server(classifier) as port:
        virtual_policy(
            rig,
            ports_of(small),
            ports_of(large),
            share=None,
            cap=100,
            scorer=external(port, timeout="100ms"),
        )
        url = rig.url()
        client = httpx.Client(timeout=10)
        wait_until(
            lambda: answered_by(client, url, HARD, ["llama-large"]),
            30,
            message="the classifier's verdict to route",
        )
        assert targets(client, url, EASY, 10) == {"llama-small": 10}
        assert targets(client, url, HARD, 10) == {"llama-large": 10}
        calls = classifier.calls

        # Slower than the timeout: the fallback (small) takes everything, nothing fails.
        classifier.delay = 0.5
        assert targets(client, url, HARD, 10) == {"llama-small": 10}
        assert classifier.calls > calls  # it was asked, and not waited for
        classifier.delay = 0.0

    # Down: the same.
    assert targets(client, url, HARD, 20) == {"llama-small": 20}
    metrics = rig.api.get("/metrics").text
    assert 'source="fallback"' in metrics


def test_the_cap_holds_when_the_classifier_calls_everything_hard_or_stops_answering(
    rig: Rig, backends: BackendFactory
) -> None:
    small, large = backends(1, id_prefix="sm"), backends(1, id_prefix="lg")
    classifier = Classifier()
    classifier.verdict = 1.0
    with json_server(classifier) as port:
        virtual_policy(
            rig,
            ports_of(small),
            ports_of(large),
            share=None,
            cap=30,
            floor=0,
            scorer=external(port, timeout="100ms", fallback="large"),
        )
        url = rig.url()
        client = httpx.Client(timeout=10)
        wait_until(
            lambda: answered_by(client, url, EASY, ["llama-small", "llama-large"]),
            30,
            message="the virtual model",
        )
        everything_hard = targets(client, url, EASY, 300)
    assert everything_hard["llama-large"] <= 0.3 * 300 + 1, everything_hard
    assert everything_hard["llama-large"] >= 0.3 * 300 - 10, everything_hard
    # Stopped answering, with the large model as fallback: the cap still holds.
    silent = targets(client, url, EASY, 300)
    assert set(silent) == {"llama-small", "llama-large"}, silent
    assert silent["llama-large"] <= 0.3 * 300 + 1, silent


def test_a_classifier_on_a_port_nobody_listens_on_fails_nothing(
    rig: Rig, backends: BackendFactory
) -> None:
    small, large = backends(1, id_prefix="sm"), backends(1, id_prefix="lg")
    virtual_policy(
        rig,
        ports_of(small),
        ports_of(large),
        share=None,
        scorer=external(free_port(), timeout="50ms"),
    )
    url = rig.url()
    client = httpx.Client(timeout=10)
    wait_until(lambda: post(client, url, HARD).status_code == 200, 30, message="the virtual model")
    assert targets(client, url, HARD, 20) == {"llama-small": 20}
    reply = post(client, url, {**HARD, "stream": True})
    assert reply.status_code == 200
    assert reply.headers["x-kvpilot-model"] == "llama-small"
    assert json.loads(reply.text.split("data: ", 2)[1].split("\n")[0])["model"] == "llama-small"
