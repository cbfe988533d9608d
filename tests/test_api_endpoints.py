"""The REST API's endpoints against a real etcd: registrations with and without a lease,
and weights set on registered and static endpoints."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from harness.api import Harness
from harness.builders import pool
from harness.wait import poll

pytestmark = pytest.mark.e2e


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


@pytest.mark.parametrize(
    ("extra", "loc", "words"),
    [
        ({"capacity": "preemptible"}, "capacity", "'on-demand', 'spot' or 'reserved'"),
        ({"locality": {"zone": "us-east-a"}}, "locality", "has no region"),
    ],
    ids=["unknown capacity", "zone without region"],
)
async def test_a_bad_capacity_or_locality_is_a_422_that_writes_nothing(
    api: Harness, extra: dict[str, Any], loc: str, words: str
) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat"))
    response = await api.http.put(
        "/v1/pools/chat/endpoints/x", json={"address": "10.0.0.1", "port": 8000, **extra}
    )
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == loc and words in detail["msg"], detail
    assert await api.raw("endpoints/chat/x") is None
    bad_pool = pool("chat", [8001])
    bad_pool["spec"]["endpoints"][0].update(extra)
    response = await api.http.put("/v1/pools/chat", json=bad_pool)
    assert response.status_code == 422, response.text
    stored = (await api.http.get("/v1/pools/chat")).json()
    assert [(e["port"], e["locality"], e["capacity"]) for e in stored["spec"]["endpoints"]] == [
        (8001, None, None),
        (8002, None, None),
    ]


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
    # The sentence names what is missing: the endpoint, and the pool when it is gone too.
    endpoint, pool_name = url.split("/")[5], url.split("/")[3]
    detail = response.json()["detail"]
    assert repr(endpoint) in detail and repr(pool_name) in detail, detail


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


async def test_an_endpoint_id_may_be_an_address_and_port(api: Harness) -> None:
    for endpoint_id in ("127.0.0.1:8000", "[::1]:8000", "replica-a"):
        response = await api.http.put(
            f"/v1/pools/chat/endpoints/{endpoint_id}", json={"address": "10.0.0.1", "port": 8000}
        )
        assert response.status_code == 200, (endpoint_id, response.text)
