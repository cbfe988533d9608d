"""Rate limits through a real Envoy: per route, and per tenant header, answered in OpenAI's
error format with rate-limit headers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from harness.auth import ADMIN_TOKEN
from harness.wait import wait_until

from controlplane.launchers import free_port

pytestmark = pytest.mark.e2e

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def test_rate_limit_per_route_and_per_tenant(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    replicas = backends(1, id_prefix="rl")
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy_factory(xds_port=kvpilot.xds_port)
    port = free_port()
    api = httpx.Client(base_url=kvpilot.api_url, headers=ADMIN, timeout=10)
    endpoint = {"address": "127.0.0.1", "port": replicas.replicas[0].port}
    assert api.put(
        "/v1/pools/rl",
        json={"kind": "Pool", "metadata": {"name": "rl"}, "spec": {"endpoints": [endpoint]}},
    ).is_success
    limit = {"requests": 3, "unit": "hour"}
    response = api.put(
        "/v1/routingpolicies/rl",
        json={
            "kind": "RoutingPolicy",
            "metadata": {"name": "rl"},
            "spec": {
                "listener": {"address": "127.0.0.1", "port": port},
                "routes": [
                    {
                        "name": "tenants",
                        "match": {
                            "pathPrefix": "/v1/",
                            "headers": [{"name": "x-api", "value": "t"}],
                        },
                        "tiers": [["rl"]],
                        "rateLimit": {**limit, "tenantHeader": "x-tenant-id"},
                    },
                    {"name": "route", "tiers": [["rl"]], "rateLimit": limit},
                ],
            },
        },
    )
    assert response.is_success, response.text
    url = f"http://127.0.0.1:{port}/v1/completions"
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
    assert "x-ratelimit-limit" in limited.headers
    assert limited.headers.get("x-backend-id") is None  # answered by Envoy, not the replica

    tenant_a = {"x-api": "t", "x-tenant-id": "a"}
    tenant_b = {"x-api": "t", "x-tenant-id": "b"}
    assert [post(tenant_a).status_code for _ in range(4)] == [200, 200, 200, 429]
    # Tenant b has a bucket of its own.
    assert [post(tenant_b).status_code for _ in range(4)] == [200, 200, 200, 429]
