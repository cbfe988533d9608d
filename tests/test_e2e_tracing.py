"""OpenTelemetry tracing end to end: a Fleet names a collector, kvpilot configures Envoy's
OpenTelemetry tracer, and a real OTLP/gRPC receiver gets one span per sampled request with
kvpilot's attributes; a client's W3C traceparent is continued and passed to the replica."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, chat, fleet, policy, pool, route
from harness.otlp import OtlpReceiver, span_attributes
from harness.rig import Rig
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    started = OtlpReceiver().start()
    yield started
    started.stop()


def test_each_sampled_request_gives_one_span_with_kvpilots_decision_and_traceparent_continues(
    rig: Rig, metrics_backends: Any, receiver: OtlpReceiver
) -> None:
    backend = metrics_backends("traced")
    classes = {
        "tenantHeader": "x-tenant",
        "classes": [
            {"name": "interactive", "objective": {"ttft": "1s"}},
            {
                "name": "batch",
                "match": {"headers": [{"name": "x-priority", "value": "batch"}]},
                "objective": {"ttft": "60s"},
            },
        ],
    }
    traced = policy(
        "web",
        rig.listener_port,
        [route("llama", match={"models": ["m"]}, sessionAffinity={"prefixHashChars": 32})],
    )
    traced["spec"]["serviceClasses"] = classes
    rig.apply(
        fleet(
            "default",
            tracing={
                "collector": f"127.0.0.1:{receiver.port}",
                "sampling": 100,
                "serviceName": "edge",
            },
        ),
        pool("llama", [backend.port], health_check=FAST_HEALTH_CHECK),
        traced,
    )
    rig.wait_ready("web/all", [backend.port])

    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    requests: list[dict[str, str]] = [
        {"x-session-id": "s-1", "x-tenant": "acme"},
        {"x-priority": "batch", "x-tenant": "globex"},
        {"traceparent": f"00-{trace_id}-{parent_id}-01", "x-tenant": "acme"},
    ]
    with httpx.Client(timeout=10) as client:
        for headers in requests:
            response = client.post(rig.url(), json=chat(model="m"), headers=headers)
            assert response.status_code == 200, response.text

    # Envoy's tracer exports in batches (every 5 s, or 5 spans).
    spans = wait_until(
        lambda: receiver.spans if len(receiver.spans) >= len(requests) else None,
        30,
        message="a span per request at the OTLP receiver",
    )
    assert len(spans) == len(requests), [s.name for _, s in spans]
    assert {service for service, _ in spans} == {"edge"}
    by_tenant_hash = {
        (attrs["kvpilot.service_class"], attrs["kvpilot.hash"]): attrs
        for attrs in (span_attributes(span) for _, span in spans)
    }
    session = by_tenant_hash[("interactive", "session")]
    assert session["kvpilot.route"] == "web/all"
    assert session["kvpilot.pool"] == "llama"
    assert session["gen_ai.request.model"] == "m"
    assert session["kvpilot.model_served"] == "m"
    assert session["kvpilot.tenant"] == "acme"
    assert session["kvpilot.endpoint"] == f"127.0.0.1:{backend.port}"
    # Without a session header, the prompt-prefix hash picked the replica.
    batch = by_tenant_hash[("batch", "prefix")]
    assert batch["kvpilot.tenant"] == "globex"

    # The client's trace is continued: the span is its child, and the replica got the
    # context with Envoy's span as parent.
    (continued,) = [span for _, span in spans if span.trace_id.hex() == trace_id]
    assert continued.parent_span_id.hex() == parent_id
    sent = backend.received[-1]["traceparent"]
    _, sent_trace, sent_parent, _ = sent.split("-")
    assert (sent_trace, sent_parent) == (trace_id, continued.span_id.hex()), sent


def test_the_fleets_sampling_rate_decides_and_a_client_cannot_force_a_trace(
    rig: Rig, metrics_backends: Any, receiver: OtlpReceiver
) -> None:
    backend = metrics_backends("sampled")
    collector = f"127.0.0.1:{receiver.port}"
    rig.apply(
        fleet("default", tracing={"collector": collector, "sampling": 0}),
        pool("llama", [backend.port], health_check=FAST_HEALTH_CHECK),
        policy("web", rig.listener_port, [route("llama", match={"models": ["m"]})]),
    )
    rig.wait_ready("web/all", [backend.port])
    client_trace = secrets.token_hex(16)
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            assert client.post(rig.url(), json=chat(model="m")).status_code == 200
        traceparent = f"00-{client_trace}-{secrets.token_hex(8)}-01"
        response = client.post(
            rig.url(), json=chat(model="m"), headers={"traceparent": traceparent}
        )
        assert response.status_code == 200
    # At 0%, the client's trace is continued but not sampled: Envoy passes it on unsampled.
    unsampled = [h["traceparent"].split("-") for h in backend.received]
    assert [flags for *_, flags in unsampled] == ["00"] * 4
    assert unsampled[-1][1] == client_trace

    # At 100%, every request is traced; none of the requests sent at 0% ever is.
    rig.apply(fleet("default", tracing={"collector": collector, "sampling": 100}))

    def traced() -> bool:
        with httpx.Client(timeout=10) as client:
            client.post(rig.url(), json=chat(model="m"))
        return bool(receiver.spans)

    wait_until(traced, 30, interval=0.5, message="a span once sampling is 100%")
    earlier = {trace for _, trace, _, _ in unsampled}
    assert not earlier & {span.trace_id.hex() for _, span in receiver.spans}
