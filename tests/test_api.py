"""The REST API against a real etcd: object CRUD with revisions, validation, and hostile
input answered with a 4xx sentence that leaves etcd untouched."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness.api import Harness
from harness.builders import fleet, policy, pool

pytestmark = pytest.mark.e2e


OBJECTS = [
    pytest.param("pools", pool("chat"), id="Pool"),
    pytest.param("routingpolicies", policy("main"), id="RoutingPolicy"),
    pytest.param("fleets", fleet("edge", accessLog=False), id="Fleet"),
    pytest.param(
        "budgets",
        {
            "kind": "Budget",
            "metadata": {"name": "acme"},
            "spec": {"tenant": "acme", "window": "day", "amount": "12.50", "currency": "EUR"},
        },
        id="Budget",
    ),
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
    pytest.param(
        "pools",
        {**pool("chat"), "spec": {"price": {"input": -1, "output": 2}}},
        "spec.price.input",
        id="negative-price",
    ),
    pytest.param(
        "pools",
        {**pool("chat"), "spec": {"price": {"input": 1, "output": 2, "currency": "XBT"}}},
        "spec.price.currency",
        id="unknown-currency",
    ),
    pytest.param(
        "budgets",
        {
            "kind": "Budget",
            "metadata": {"name": "b"},
            "spec": {"tenant": "t", "window": "week", "tokens": 5},
        },
        "spec.window",
        id="window",
    ),
    pytest.param(
        "budgets",
        {"kind": "Budget", "metadata": {"name": "b"}, "spec": {"tenant": "t", "window": "day"}},
        "spec",
        id="no-limit",
    ),
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
    ("content", "says"),
    [
        (b"{nope", "the request body is not valid JSON: "),
        (b"", "the request needs a JSON body"),
        (b'{"kind": "Pool", "spec": {"connectTimeout": 1e999}}', "not valid JSON: "),
        (b"NaN", "not valid JSON: "),
    ],
)
async def test_non_json_body_is_a_400_sentence(api: Harness, content: bytes, says: str) -> None:
    response = await api.http.post("/v1/pools", content=content)
    assert response.status_code == 400
    assert says in response.json()["detail"], response.json()


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


async def test_an_if_match_beyond_etcd_revisions_is_a_400(api: Harness) -> None:
    assert (await api.http.post("/v1/pools", json=pool("chat"))).status_code == 201
    for method in ("PUT", "DELETE"):
        response = await api.http.request(
            method, "/v1/pools/chat", json=pool("chat"), headers={"If-Match": '"' + "9" * 400 + '"'}
        )
        assert response.status_code == 400, response.text
