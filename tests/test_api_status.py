"""What the REST API reports against a real etcd: dry runs that write nothing, the config a
fleet is served, status, health, readiness and the OpenAPI document."""

from __future__ import annotations

from typing import Any

import pytest
from harness.api import Harness, running_api
from harness.builders import policy, pool
from harness.wait import poll

from controlplane.local import EmbeddedEtcd

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_dry_run_returns_envoy_resources_and_writes_nothing(
    api: Harness, method: str
) -> None:
    await api.http.put("/v1/routingpolicies/main", json=policy("main"))
    if method == "DELETE":
        await api.http.put("/v1/pools/chat", json=pool("chat"))
    # What is under this test's prefix, key by key (etcd's own revision is shared with every
    # other test's prefix on the same server, and moves with their writes).
    before, _ = await api.client.get_prefix(f"{api.prefix}/".encode())

    if method == "POST":
        response = await api.http.post("/v1/pools", json=pool("chat"), params={"dryRun": "true"})
    elif method == "PUT":
        response = await api.http.put(
            "/v1/pools/chat", json=pool("chat"), params={"dryRun": "true"}
        )
    else:
        response = await api.http.delete("/v1/pools/chat", params={"dryRun": "true"})

    assert response.status_code == 200, response.text
    preview = response.json()
    assert preview["dryRun"] is True
    resources = preview["fleets"]["default"]
    assert [c["name"] for c in resources["clusters"]] == ["main/all"]
    assert [listener["name"] for listener in resources["listeners"]] == ["listener-10000"]
    assignment = resources["endpoints"][0]
    hosts = [
        lb["endpoint"]["address"]["socketAddress"]["portValue"]
        for locality in assignment.get("endpoints", [])
        for lb in locality["lbEndpoints"]
    ]
    if method == "DELETE":
        assert hosts == []
        assert any("does not exist" in d["message"] for d in preview["diagnostics"])
    else:
        assert sorted(hosts) == [8001, 8002]
    after, _ = await api.client.get_prefix(f"{api.prefix}/".encode())
    assert [(kv.key, kv.mod_revision) for kv in after] == [
        (kv.key, kv.mod_revision) for kv in before
    ]
    assert (await api.raw("objects/pools/chat") is None) == (method != "DELETE")


async def test_dry_run_create_of_an_existing_object_is_a_conflict(api: Harness) -> None:
    await api.http.post("/v1/pools", json=pool("chat"))
    response = await api.http.post("/v1/pools", json=pool("chat"), params={"dryRun": "true"})
    assert response.status_code == 409


async def test_fleet_config_shows_what_is_served_with_versions(api: Harness) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat"))
    await api.http.put("/v1/routingpolicies/main", json=policy("main"))

    async def served() -> dict[str, Any] | None:
        response = await api.http.get("/v1/fleets/default/config")
        body: dict[str, Any] = response.json()
        if response.status_code == 200 and body["clusters"] and body["listeners"]:
            return body
        return None

    config = await poll(served, message="the snapshot serves the policy")
    assert set(config["versions"]) == {"clusters", "endpoints", "listeners", "routes"}
    assert all(config["versions"].values())
    assert config["clusters"][0]["name"] == "main/all"
    assert config["clusters"][0]["resource"]["name"] == "main/all"
    other = (await api.http.get("/v1/fleets/elsewhere/config")).json()
    assert other["servedFrom"] == "default"


async def test_status_reports_invalid_objects_diagnostics_and_last_build(api: Harness) -> None:
    await api.client.put(f"{api.prefix}/objects/pools/broken".encode(), b'{"kind": "Pool"}')
    await api.http.put("/v1/routingpolicies/main", json=policy("main", pools=("missing",)))

    async def reported() -> dict[str, Any] | None:
        body: dict[str, Any] = (await api.http.get("/v1/status")).json()
        return body if body["invalidObjects"] and body["diagnostics"] else None

    status = await poll(reported, message="status shows the bad pool and the dangling reference")
    assert status["invalidObjects"][0]["key"] == "objects/pools/broken"
    assert "missing" in status["diagnostics"][0]["message"]
    assert status["envoys"] == []
    assert status["lastBuild"]["revision"] > 0
    assert "default" in status["lastBuild"]["fleets"]


async def test_health_ready_and_metrics(api: Harness) -> None:
    assert (await api.http.get("/healthz", headers={})).json() == {"status": "ok"}
    await poll(
        lambda: _ok(api, "/readyz"), message="ready once etcd answers and a snapshot is built"
    )
    metrics = await api.http.get("/metrics", headers={"Authorization": ""})
    assert metrics.status_code == 200
    assert "kvpilot_reconcile_builds" in metrics.text


async def _ok(api: Harness, path: str) -> bool:
    return (await api.http.get(path, headers={"Authorization": ""})).status_code == 200


async def test_readyz_is_503_before_the_first_snapshot(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    async with running_api(etcd.endpoint, etcd_prefix) as api:
        # Once the first build is done nothing else rebuilds (no etcd change follows); a
        # clear before it would race the build, which a change finding the reconciler idle
        # starts at once.
        await poll(lambda: api.reconciler.ready, message="the first snapshot")
        api.reconciler._built.clear()  # as if the first build had not happened yet
        response = await api.http.get("/readyz")
        assert response.status_code == 503
        assert "snapshot" in response.json()["detail"]


async def test_etcd_unreachable_is_a_503_sentence(etcd_prefix: str) -> None:
    from controlplane.local import free_port

    async with running_api(f"127.0.0.1:{free_port()}", etcd_prefix) as api:
        api.client.timeout = 0.3
        response = await api.http.get("/v1/pools")
        assert response.status_code == 503
        assert "etcd" in response.json()["detail"]
        ready = await api.http.get("/readyz")
        assert ready.status_code == 503
        assert "etcd is unreachable" in ready.json()["detail"]


async def test_openapi_documents_the_object_bodies(api: Harness) -> None:
    schema = (await api.http.get("/openapi.json")).json()
    body = schema["paths"]["/v1/pools"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/Pool"}
    assert "PoolSpec" in schema["components"]["schemas"]
