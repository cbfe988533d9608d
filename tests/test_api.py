"""The REST API against a real etcd: CRUD with revisions, validation, dry runs, endpoints."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness.api import Harness, running_api
from harness.builders import fleet, policy, pool
from harness.wait import poll

from controlplane.launchers import EmbeddedEtcd

pytestmark = pytest.mark.e2e


@pytest.fixture
async def api(etcd: EmbeddedEtcd, etcd_prefix: str) -> AsyncIterator[Harness]:
    async with running_api(etcd.endpoint, etcd_prefix) as harness:
        yield harness


OBJECTS = [
    pytest.param("pools", pool("chat"), id="Pool"),
    pytest.param("routingpolicies", policy("main"), id="RoutingPolicy"),
    pytest.param("fleets", fleet("edge", accessLog=False), id="Fleet"),
]


@pytest.mark.parametrize(("path", "body"), OBJECTS)
async def test_every_kind_round_trips_through_rest_and_etcd(
    api: Harness, path: str, body: dict[str, Any]
) -> None:
    name = body["metadata"]["name"]
    created = await api.http.post(f"/v1/{path}", json=body)
    assert created.status_code == 201, created.text
    revision = created.headers["etag"]
    stored = json.loads(await api.raw(f"objects/{path}/{name}") or b"null")
    assert stored == created.json()
    assert stored["metadata"]["name"] == name
    kv = await api.client.get(f"{api.prefix}/objects/{path}/{name}".encode())
    assert kv is not None
    assert revision == f'"{kv.mod_revision}"'

    got = await api.http.get(f"/v1/{path}/{name}")
    assert got.status_code == 200
    assert got.headers["etag"] == revision
    assert got.json() == created.json()
    listed = (await api.http.get(f"/v1/{path}")).json()
    assert [item["metadata"]["name"] for item in listed["items"]] == [name]
    assert listed["revision"] >= int(revision.strip('"'))

    # Defaults are filled in, camelCase on the wire, and it reads back as it went in.
    replaced = await api.http.put(
        f"/v1/{path}/{name}", json=got.json(), headers={"If-Match": revision}
    )
    assert replaced.status_code == 200, replaced.text
    assert replaced.json() == got.json()
    assert replaced.headers["etag"] != revision

    deleted = await api.http.delete(f"/v1/{path}/{name}")
    assert deleted.status_code == 204
    assert await api.raw(f"objects/{path}/{name}") is None
    assert (await api.http.get(f"/v1/{path}/{name}")).status_code == 404
    assert (await api.http.delete(f"/v1/{path}/{name}")).status_code == 404


async def test_stored_objects_are_normalized_with_defaults_in_camel_case(api: Harness) -> None:
    response = await api.http.post("/v1/pools", json=pool("chat"))
    spec = response.json()["spec"]
    assert spec["connectTimeout"] == "5s"
    assert spec["healthCheck"]["unhealthyThreshold"] == 2
    assert spec["endpoints"][0]["weight"] == 100


async def test_put_creates_then_replaces(api: Harness) -> None:
    first = await api.http.put("/v1/pools/chat", json=pool("chat"))
    assert first.status_code == 201
    second = await api.http.put("/v1/pools/chat", json=pool("chat", [9000]))
    assert second.status_code == 200
    assert second.json()["spec"]["endpoints"][0]["port"] == 9000


async def test_kind_may_be_left_out_of_the_body(api: Harness) -> None:
    body = pool("chat")
    del body["kind"]
    assert (await api.http.post("/v1/pools", json=body)).status_code == 201


async def test_create_twice_is_a_conflict(api: Harness) -> None:
    assert (await api.http.post("/v1/pools", json=pool("chat"))).status_code == 201
    again = await api.http.post("/v1/pools", json=pool("chat", [9000]))
    assert again.status_code == 409
    assert "already exists" in again.json()["detail"]
    stored = json.loads(await api.raw("objects/pools/chat") or b"{}")
    assert stored["spec"]["endpoints"][0]["port"] == 8001


INVALID = [
    pytest.param(
        "pools",
        {**pool("chat"), "spec": {"endpoints": [{"address": "a", "port": 0}]}},
        "spec.endpoints[0].port",
        id="port-zero",
    ),
    pytest.param(
        "routingpolicies",
        {**policy("main"), "spec": {"routes": [{"name": "r", "tiers": []}]}},
        "spec.routes[0].tiers",
        id="no-tiers",
    ),
    pytest.param("pools", {**pool("chat"), "spec": {"colour": "red"}}, "spec.colour", id="unknown"),
    pytest.param(
        "pools", {**pool("chat"), "metadata": {"name": "Bad_Name"}}, "metadata.name", id="name"
    ),
    pytest.param("pools", policy("main"), "kind", id="wrong-kind"),
    pytest.param("fleets", {**fleet("x"), "apiVersion": "v2"}, "apiVersion", id="api-version"),
]


@pytest.mark.parametrize(("path", "body", "loc"), INVALID)
async def test_invalid_bodies_get_422_with_field_paths_and_leave_etcd_untouched(
    api: Harness, path: str, body: dict[str, Any], loc: str
) -> None:
    name = body["metadata"]["name"]
    for response in (
        await api.http.post(f"/v1/{path}", json=body),
        await api.http.put(f"/v1/{path}/{name}", json=body),
        await api.http.post(f"/v1/{path}", json=body, params={"dryRun": "true"}),
    ):
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        # A PUT of a bad name fails on its path, by the same rule.
        locs = [error["loc"] for error in detail]
        assert loc in locs or (loc == "metadata.name" and locs == ["path.name"]), detail
        assert all(error["msg"] for error in detail)
    assert await api.raw(f"objects/{path}/{name}") is None
    kvs, _ = await api.client.get_prefix(f"{api.prefix}/".encode())
    assert kvs == []


async def test_name_in_body_must_match_the_path(api: Harness) -> None:
    response = await api.http.put("/v1/pools/other", json=pool("chat"))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "metadata.name"
    assert await api.raw("objects/pools/other") is None
    assert await api.raw("objects/pools/chat") is None


@pytest.mark.parametrize(
    "content", [b"{nope", b"", b'{"kind": "Pool", "spec": {"connectTimeout": 1e999}}', b"NaN"]
)
async def test_non_json_body_is_a_400_sentence(api: Harness, content: bytes) -> None:
    response = await api.http.post("/v1/pools", content=content)
    assert response.status_code == 400
    assert isinstance(response.json()["detail"], str)


async def test_a_kind_that_is_not_a_string_is_a_422(api: Harness) -> None:
    response = await api.http.post("/v1/pools", json={**pool("chat"), "kind": []})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "kind"


async def test_stale_if_match_gets_412(api: Harness) -> None:
    created = await api.http.post("/v1/pools", json=pool("chat"))
    etag = created.headers["etag"]
    assert (await api.http.put("/v1/pools/chat", json=pool("chat", [9001]))).status_code == 200
    stale = await api.http.put(
        "/v1/pools/chat", json=pool("chat", [9002]), headers={"If-Match": etag}
    )
    assert stale.status_code == 412
    assert "changed by someone else" in stale.json()["detail"]
    stale_delete = await api.http.delete("/v1/pools/chat", headers={"If-Match": etag})
    assert stale_delete.status_code == 412
    assert await api.raw("objects/pools/chat") is not None


async def test_if_match_on_a_deleted_object_gets_412(api: Harness) -> None:
    etag = (await api.http.post("/v1/pools", json=pool("chat"))).headers["etag"]
    assert (await api.http.delete("/v1/pools/chat")).status_code == 204
    response = await api.http.put("/v1/pools/chat", json=pool("chat"), headers={"If-Match": etag})
    assert response.status_code == 412
    assert await api.raw("objects/pools/chat") is None


async def test_malformed_if_match_is_a_400(api: Harness) -> None:
    await api.http.post("/v1/pools", json=pool("chat"))
    response = await api.http.put("/v1/pools/chat", json=pool("chat"), headers={"If-Match": "abc"})
    assert response.status_code == 400


async def test_concurrent_updates_with_the_same_if_match_exactly_one_wins(api: Harness) -> None:
    etag = (await api.http.post("/v1/pools", json=pool("chat"))).headers["etag"]
    responses = await asyncio.gather(
        api.http.put("/v1/pools/chat", json=pool("chat", [9001]), headers={"If-Match": etag}),
        api.http.put("/v1/pools/chat", json=pool("chat", [9002]), headers={"If-Match": etag}),
    )
    assert sorted(r.status_code for r in responses) == [200, 412]
    winner = next(r for r in responses if r.status_code == 200)
    stored = json.loads(await api.raw("objects/pools/chat") or b"{}")
    assert stored == winner.json()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_dry_run_returns_envoy_resources_and_writes_nothing(
    api: Harness, method: str
) -> None:
    await api.http.put("/v1/routingpolicies/main", json=policy("main"))
    if method == "DELETE":
        await api.http.put("/v1/pools/chat", json=pool("chat"))
    _, revision_before = await api.client.get_prefix(f"{api.prefix}/".encode())

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
    _, revision_after = await api.client.get_prefix(f"{api.prefix}/".encode())
    assert revision_after == revision_before
    assert (await api.raw("objects/pools/chat") is None) == (method != "DELETE")


async def test_dry_run_create_of_an_existing_object_is_a_conflict(api: Harness) -> None:
    await api.http.post("/v1/pools", json=pool("chat"))
    response = await api.http.post("/v1/pools", json=pool("chat"), params={"dryRun": "true"})
    assert response.status_code == 409


async def test_registered_endpoints_are_listed_and_expire_with_their_lease(api: Harness) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat"))
    forever = await api.http.put(
        "/v1/pools/chat/endpoints/replica-a", json={"address": "10.0.0.1", "port": 8000}
    )
    assert forever.status_code == 200, forever.text
    assert forever.json()["lease"] is None
    leased = await api.http.put(
        "/v1/pools/chat/endpoints/replica-b",
        json={"address": "10.0.0.2", "port": 8000, "weight": 7},
        params={"ttl": 1},
    )
    assert leased.status_code == 200
    assert leased.json()["lease"]

    listed = (await api.http.get("/v1/pools/chat/endpoints")).json()["items"]
    assert {item["id"]: item["endpoint"]["weight"] for item in listed} == {
        "replica-a": 100,
        "replica-b": 7,
    }
    assert next(i for i in listed if i["id"] == "replica-b")["lease"] == leased.json()["lease"]

    async def expired() -> bool:
        items = (await api.http.get("/v1/pools/chat/endpoints")).json()["items"]
        return [item["id"] for item in items] == ["replica-a"]

    await poll(expired, within=15, message="the leased registration expires")
    assert (await api.http.delete("/v1/pools/chat/endpoints/replica-a")).status_code == 204
    assert (await api.http.delete("/v1/pools/chat/endpoints/replica-a")).status_code == 404


async def test_invalid_endpoint_registration_is_a_422(api: Harness) -> None:
    response = await api.http.put(
        "/v1/pools/chat/endpoints/x", json={"address": "10.0.0.1", "port": 70000}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "port"
    assert await api.raw("endpoints/chat/x") is None


async def test_set_weight_of_a_registered_endpoint_keeps_its_lease(api: Harness) -> None:
    leased = await api.http.put(
        "/v1/pools/chat/endpoints/r1",
        json={"address": "10.0.0.1", "port": 8000},
        params={"ttl": 60},
    )
    response = await api.http.put("/v1/pools/chat/endpoints/r1/weight", json={"weight": 42})
    assert response.status_code == 200, response.text
    assert response.json()["source"] == "registered"
    kv = await api.client.get(f"{api.prefix}/endpoints/chat/r1".encode())
    assert kv is not None
    assert json.loads(kv.value)["weight"] == 42
    assert kv.lease == leased.json()["lease"]


async def test_set_weight_of_a_static_endpoint_rewrites_the_pool(api: Harness) -> None:
    etag = (await api.http.put("/v1/pools/chat", json=pool("chat"))).headers["etag"]
    response = await api.http.put(
        "/v1/pools/chat/endpoints/127.0.0.1:8002/weight", json={"weight": 5}
    )
    assert response.status_code == 200, response.text
    assert response.json()["source"] == "static"
    got = await api.http.get("/v1/pools/chat")
    assert [e["weight"] for e in got.json()["spec"]["endpoints"]] == [100, 5]
    assert got.headers["etag"] != etag


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/pools/chat/endpoints/127.0.0.1:9999/weight", {"weight": 5}),
        ("/v1/pools/nopool/endpoints/x/weight", {"weight": 5}),
    ],
)
async def test_set_weight_of_an_unknown_endpoint_is_a_404(
    api: Harness, url: str, body: dict[str, Any]
) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat"))
    response = await api.http.put(url, json=body)
    assert response.status_code == 404
    assert isinstance(response.json()["detail"], str)


async def test_set_weight_out_of_range_is_a_422(api: Harness) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat"))
    response = await api.http.put(
        "/v1/pools/chat/endpoints/127.0.0.1:8001/weight", json={"weight": 0}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "weight"


async def test_concurrent_static_weight_changes_are_both_kept(api: Harness) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat", [8001, 8002, 8003]))
    responses = await asyncio.gather(
        *(
            api.http.put(f"/v1/pools/chat/endpoints/127.0.0.1:{port}/weight", json={"weight": w})
            for port, w in ((8001, 11), (8002, 22), (8003, 33))
        )
    )
    assert [r.status_code for r in responses] == [200, 200, 200]
    got = (await api.http.get("/v1/pools/chat")).json()
    assert [e["weight"] for e in got["spec"]["endpoints"]] == [11, 22, 33]


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
    from controlplane.launchers import free_port

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


# Hostile input: every answer is a 4xx sentence, never a 5xx, and etcd is left untouched ------


def nested(depth: int) -> bytes:
    return b'{"spec": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [100, 10_000])
async def test_a_deeply_nested_body_is_a_4xx(api: Harness, depth: int) -> None:
    for method, url in (
        ("POST", "/v1/pools"),
        ("PUT", "/v1/pools/chat"),
        ("PUT", "/v1/pools/chat/endpoints/e1"),
        ("PUT", "/v1/pools/chat/endpoints/e1/weight"),
    ):
        response = await api.http.request(method, url, content=nested(depth))
        assert response.status_code in (400, 422), (url, response.text)
        assert "nested" in str(response.json()["detail"]) or response.status_code == 422
    assert await api.raw("objects/pools/chat") is None


async def test_a_body_over_the_limit_is_a_413_that_names_the_limit(api: Harness) -> None:
    from api.context import MAX_BODY_BYTES

    huge = pool("chat", range(1, 2))
    huge["spec"]["models"] = [f"model-{i:07d}" for i in range(MAX_BODY_BYTES // 16)]
    for method, url in (("POST", "/v1/pools"), ("PUT", "/v1/pools/chat")):
        response = await api.http.request(method, url, json=huge)
        assert response.status_code == 413, response.text
        assert f"{MAX_BODY_BYTES:,}" in response.json()["detail"]
    # Without a Content-Length (chunked), the reader stops at the limit too.

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(MAX_BODY_BYTES // 65_536 + 2):
            yield b" " * 65_536

    response = await api.http.post("/v1/pools", content=chunks())
    assert response.status_code == 413
    assert await api.raw("objects/pools/chat") is None


async def test_duplicate_keys_in_a_body_are_a_400(api: Harness) -> None:
    response = await api.http.post(
        "/v1/pools", content=b'{"kind": "Pool", "kind": "Fleet", "metadata": {"name": "x"}}'
    )
    assert response.status_code == 400
    assert "'kind'" in response.json()["detail"]


async def test_a_stored_value_that_is_not_json_is_a_clear_409_naming_the_key(
    api: Harness,
) -> None:
    key = f"{api.prefix}/objects/pools/chat"
    for garbage in (b"\xff not json", b"[" * 5000 + b"]" * 5000):
        await api.client.put(key.encode(), garbage)
        response = await api.http.get("/v1/pools/chat")
        assert response.status_code == 409, response.text
        detail = response.json()["detail"]
        assert key in detail and "DELETE" in detail
    # It can be replaced, and then reads back.
    assert (await api.http.put("/v1/pools/chat", json=pool("chat"))).status_code in (200, 201)
    assert (await api.http.get("/v1/pools/chat")).status_code == 200


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("PUT", "/v1/pools/bad%20pool/endpoints/e1"),
        ("PUT", f"/v1/pools/{'p' * 300}/endpoints/e1"),
        ("PUT", "/v1/pools/chat/endpoints/e%20one"),
        ("PUT", f"/v1/pools/chat/endpoints/{'e' * 300}"),
        ("PUT", "/v1/pools/UPPER/endpoints/e1/weight"),
        ("DELETE", "/v1/pools/bad%20pool/endpoints/e1"),
        ("GET", "/v1/pools/bad%20pool/endpoints"),
        ("GET", "/v1/pools/Bad"),
        ("DELETE", f"/v1/routingpolicies/{'r' * 64}"),
        ("GET", "/v1/fleets/%E2%9C%93/config"),
    ],
)
async def test_path_parameters_follow_the_name_rules(api: Harness, method: str, url: str) -> None:
    response = await api.http.request(
        method, url, json={"address": "10.0.0.1", "port": 8000, "weight": 2}
    )
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"].startswith("path.") and "is not a valid" in error["msg"], error
    kvs, _ = await api.client.get_prefix(f"{api.prefix}/".encode())
    assert [kv.key for kv in kvs if b"/endpoints/" in kv.key or b"/objects/" in kv.key] == []


async def test_an_endpoint_id_may_be_an_address_and_port(api: Harness) -> None:
    for endpoint_id in ("127.0.0.1:8000", "[::1]:8000", "replica-a"):
        response = await api.http.put(
            f"/v1/pools/chat/endpoints/{endpoint_id}", json={"address": "10.0.0.1", "port": 8000}
        )
        assert response.status_code == 200, (endpoint_id, response.text)


async def test_an_if_match_beyond_etcd_revisions_is_a_400(api: Harness) -> None:
    assert (await api.http.post("/v1/pools", json=pool("chat"))).status_code == 201
    for method in ("PUT", "DELETE"):
        response = await api.http.request(
            method, "/v1/pools/chat", json=pool("chat"), headers={"If-Match": '"' + "9" * 400 + '"'}
        )
        assert response.status_code == 400, response.text
