"""Rate limits through a real Envoy: per route, and per tenant header, answered in OpenAI's
error format with rate-limit headers."""

from __future__ import annotations

import httpx
import pytest
from harness.builders import policy, pool, route
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


def test_rate_limit_per_route_and_per_tenant(rig: Rig, backends: BackendFactory) -> None:
    replicas = backends(1, id_prefix="rl")
    limit = {"requests": 3, "unit": "hour"}
    tenants = {"pathPrefix": "/v1/", "headers": [{"name": "x-api", "value": "t"}]}
    rig.apply(
        pool("rl", ports_of(replicas)),
        policy(
            "rl",
            rig.listener_port,
            [
                route(
                    "rl",
                    name="tenants",
                    match=tenants,
                    rateLimit={**limit, "tenantHeader": "x-tenant-id"},
                ),
                route("rl", name="route", rateLimit=limit),
            ],
        ),
    )
    url = rig.url("/v1/completions")
    client = httpx.Client(timeout=10)

    def post(headers: dict[str, str] | None = None) -> httpx.Response:
        return client.post(url, json={"model": "m", "prompt": "hi"}, headers=headers or {})

    # The first answered request proves the config arrived; it spends one token.
    wait_until(lambda: post().status_code == 200, 30, message="the route to serve")
    statuses = [post().status_code for _ in range(2)]
    assert statuses == [200, 200]
    limited = post()
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    # Draft 03 headers: the bucket's size, nothing left, and seconds until the next token
    # (3 an hour: one every 1,200 s).
    assert limited.headers["x-ratelimit-limit"] == "3", limited.headers
    assert limited.headers["x-ratelimit-remaining"] == "0", limited.headers
    assert 0 < int(limited.headers["x-ratelimit-reset"]) <= 3600 // 3, limited.headers
    assert limited.headers.get("x-backend-id") is None  # answered by Envoy, not the replica

    tenant_a = {"x-api": "t", "x-tenant-id": "a"}
    tenant_b = {"x-api": "t", "x-tenant-id": "b"}
    assert [post(tenant_a).status_code for _ in range(4)] == [200, 200, 200, 429]
    # Tenant b has a bucket of its own.
    assert [post(tenant_b).status_code for _ in range(4)] == [200, 200, 200, 429]
