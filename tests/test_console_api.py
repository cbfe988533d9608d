"""The REST views the console reads, and the endpoint health it writes, against a real etcd."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness.api import Harness
from harness.auth import READ
from harness.builders import policy, pool, route, service_classes
from harness.wait import poll

pytestmark = pytest.mark.e2e


def telemetry_policy() -> dict[str, Any]:
    return policy("main", routes=[route("chat", balancing="telemetry")])


async def view(api: Harness, query: str = "") -> dict[str, Any]:
    response = await api.http.get(f"/v1/endpoints{query}", headers=READ)
    assert response.status_code == 200, response.text
    return {e["id"]: e for p in response.json()["pools"] for e in p["endpoints"]}


async def test_endpoints_view_shows_weights_health_telemetry_and_why(api: Harness) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat", [8001, 8002, 8003]))
    await api.http.put("/v1/routingpolicies/main", json=telemetry_policy())
    await api.store.put_endpoint("chat", "r1", {"address": "127.0.0.2", "port": 9000})
    now = time.time()
    hot = {"at": now, "waiting": 40.0, "running": 30.0, "max_running": 32.0, "kv_cache": 0.99}
    cold = {"at": now, "waiting": 0.0, "running": 1.0, "max_running": 32.0, "kv_cache": 0.1}
    await api.store.put_telemetry("chat", "127.0.0.1:8001", hot)
    await api.store.put_telemetry("chat", "127.0.0.1:8002", cold)
    await api.store.put_telemetry("chat", "127.0.0.1:8003", {**cold, "at": now - 600})

    async def settled() -> dict[str, Any] | None:
        rows = await view(api, "?history=true")
        with_telemetry = [row for row in rows.values() if row["telemetry"]]
        return rows if len(rows) == 4 and len(with_telemetry) == 3 else None

    rows = await poll(settled, message="the view to hold the telemetry")
    assert set(rows) == {"127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003", "r1"}
    assert rows["r1"]["source"] == "registered" and rows["r1"]["address"] == "127.0.0.2"
    hot_row = rows["127.0.0.1:8001"]
    assert hot_row["weight"] == 100 and hot_row["effectiveWeight"] < 100
    assert hot_row["effectiveHealth"] == "degraded" and hot_row["health"] == "healthy"
    assert any("saturated" in reason for reason in hot_row["reasons"])
    assert hot_row["telemetry"]["waiting"] == 40.0
    assert hot_row["history"]["waiting"] == [40.0]
    assert any("stale" in reason for reason in rows["127.0.0.1:8003"]["reasons"])
    assert rows["r1"]["reasons"] == ["no telemetry: static weight"]
    assert "history" not in (await view(api))["r1"]

    metrics = (await api.http.get("/metrics")).text
    assert 'kvpilot_pool_endpoints{health="degraded",pool="chat"} 1.0' in metrics
    assert 'kvpilot_pool_endpoints{health="healthy",pool="chat"} 3.0' in metrics


async def test_a_capacity_weight_says_the_replica_is_slower_not_loaded(api: Harness) -> None:
    """Behind session affinity telemetry sets capacity from speed, not load: the view says so."""
    await api.http.put("/v1/pools/chat", json=pool("chat", [8001, 8002, 8003]))
    body = policy(
        "main", routes=[route("chat", name="chat", balancing="telemetry", sessionAffinity={})]
    )
    await api.http.put("/v1/routingpolicies/main", json=body)

    async def cut() -> dict[str, Any] | None:
        # Like an agent: a round of records, the first replica 3x slower, until two rounds
        # in a row have reached the weight function and the capacity factor moves.
        now = time.time()
        await api.store.put_telemetry_many(
            [
                ("chat", f"127.0.0.1:{port}", {"at": now, "time_per_output_token": tpot})
                for port, tpot in ((8001, 0.09), (8002, 0.03), (8003, 0.03))
            ],
            lease=0,
        )
        rows = await view(api)
        slow = rows.get("127.0.0.1:8001")
        return rows if slow is not None and slow["effectiveWeight"] == 35 else None

    rows = await poll(cut, message="the 3x slower replica's weight to fall to 35")
    assert rows["127.0.0.1:8001"]["reasons"] == [
        "slower than the pool's median (last speed 0.33): capacity 35% of static"
    ]
    assert rows["127.0.0.1:8002"]["effectiveWeight"] == 100
    assert rows["127.0.0.1:8002"]["reasons"] == []


@pytest.mark.parametrize("endpoint_id", ["127.0.0.1:8001", "r1"])
async def test_drain_and_undrain_an_endpoint(api: Harness, endpoint_id: str) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat", [8001, 8002]))
    await api.store.put_endpoint("chat", "r1", {"address": "127.0.0.2", "port": 9000}, ttl=60)
    path = f"/v1/pools/chat/endpoints/{endpoint_id}/health"

    refused = await api.http.put(path, json={"health": "draining"}, headers=READ)
    assert refused.status_code == 403
    bad = await api.http.put(path, json={"health": "sleepy"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == "health"

    drained = await api.http.put(path, json={"health": "draining"})
    assert drained.status_code == 200, drained.text
    assert drained.json()["health"] == "draining"
    rows = await poll(
        lambda: _health(api, endpoint_id, "draining"), message="the view to show it draining"
    )
    assert "draining: set on the endpoint" in rows[endpoint_id]["reasons"]
    metrics = (await api.http.get("/metrics")).text
    assert 'kvpilot_pool_endpoints{health="draining",pool="chat"} 1.0' in metrics
    if endpoint_id == "r1":  # a registration keeps its lease
        kv = await api.client.get(f"{api.prefix}/endpoints/chat/r1".encode())
        assert kv is not None and kv.lease

    assert (await api.http.put(path, json={"health": "healthy"})).status_code == 200
    await poll(lambda: _health(api, endpoint_id, "healthy"), message="back in rotation")
    missing = await api.http.put(
        "/v1/pools/chat/endpoints/127.0.0.1:1/health", json={"health": "draining"}
    )
    assert missing.status_code == 404


async def _health(api: Harness, endpoint_id: str, health: str) -> dict[str, Any] | None:
    rows = await view(api)
    return rows if rows.get(endpoint_id, {}).get("effectiveHealth") == health else None


async def test_history_lists_revisions_with_diffs_newest_first(api: Harness) -> None:
    body = pool("chat", [8001], models=["m"])
    created = await api.http.put("/v1/pools/chat", json=body)
    body["spec"]["endpoints"][0]["weight"] = 300
    await api.http.put("/v1/pools/chat", json=body)
    body["spec"]["models"] = ["m", "m2"]
    updated = await api.http.put("/v1/pools/chat", json=body)

    response = await api.http.get("/v1/history", headers=READ)
    assert response.status_code == 200
    items = response.json()["items"]
    assert [i["change"] for i in items] == ["updated", "updated", "created"]
    assert items[0]["revision"] == int(updated.headers["etag"].strip('"'))
    assert items[-1]["revision"] == int(created.headers["etag"].strip('"'))
    assert "+  - m2" in items[0]["diff"]
    assert "-    weight: 100" in items[1]["diff"] and "+    weight: 300" in items[1]["diff"]
    assert (await api.http.get("/v1/history?limit=1", headers=READ)).json()["items"] == items[:1]

    # Once etcd compacts, what it no longer holds is said, not guessed; what was read before
    # is kept (a revision's predecessor never changes).
    other = pool("other", [8001])
    await api.http.put("/v1/pools/other", json=other)
    other["spec"]["models"] = ["x"]
    last = await api.http.put("/v1/pools/other", json=other)
    await api.client.compact(int(last.headers["etag"].strip('"')))
    after = (await api.http.get("/v1/history", headers=READ)).json()
    assert after["compacted"] is True
    assert [(i["name"], i["change"]) for i in after["items"]] == [
        ("other", "updated (earlier history compacted)"),
        ("chat", "updated"),
        ("chat", "updated"),
        ("chat", "created"),
    ]


async def test_history_names_who_made_each_change_from_the_audit_log(api: Harness) -> None:
    body = pool("chat", [8001], models=["m"])
    await api.http.put("/v1/pools/chat", json=body)  # by "ops", the harness's admin token
    # Past the REST API (as etcdctl or a restore would write): no audit entry to join.
    body["spec"]["models"] = ["quiet"]
    await api.store.replace("Pool", "chat", body, expect_revision=None)

    async def authored() -> list[dict[str, Any]] | None:
        items = (await api.http.get("/v1/history", headers=READ)).json()["items"]
        return items if len(items) == 2 else None

    latest, created = await poll(authored, message="both revisions in the history")
    assert created["author"]["actor"] == "ops"
    assert created["author"]["operation"] == "replace_pools"
    assert abs(created["author"]["at"] - time.time()) < 60
    assert latest["change"] == "updated" and latest["author"] is None


async def test_admission_shows_each_class_state_since_and_the_pressure_against_its_bounds(
    api: Harness,
) -> None:
    saturation = {"queue": 4, "step": 100, "shedInterval": "100ms", "high": 1.0, "low": 0.5}
    classes = service_classes(saturation=saturation, whenSaturated="shed", retryAfter="7s")
    body = telemetry_policy()
    body["spec"]["serviceClasses"] = classes
    await api.http.put("/v1/pools/chat", json=pool("chat", [8001, 8002]))
    assert (await api.http.put("/v1/routingpolicies/main", json=body)).status_code in (200, 201)

    async def route() -> dict[str, Any] | None:
        response = await api.http.get("/v1/admission", headers=READ)
        assert response.status_code == 200, response.text
        policies = response.json()["policies"]
        return policies[0]["routes"][0] if policies else None

    calm = await poll(route, message="the route in the admission view")
    assert calm["route"] == "main/all" and calm["pools"] == ["chat"]
    assert calm["pressure"] is None and calm["signals"] == []  # no telemetry: all admitted
    assert [(c["name"], c["state"], c["fallback"]) for c in calm["classes"]] == [
        ("interactive", "admitted", True),
        ("batch", "admitted", False),
    ]
    batch = calm["classes"][1]
    assert batch["whenSaturated"] == "shed" and batch["retryAfter"] == 7
    assert batch["objective"] == {"ttft": 60.0}
    assert batch["runtimeKey"] == "kvpilot.admission.main.all.batch"
    assert batch["stats"] == {
        "admitted": "vhost.main.route.all.batch.upstream_rq_completed",
        "shed": "all.batch.shed.http_local_rate_limit.enabled",
    }

    saturated_at = time.time()
    for port in (8001, 8002):
        record = {"at": time.time(), "waiting": 10.0, "running": 4.0, "kv_cache": 0.5}
        await api.store.put_telemetry("chat", f"127.0.0.1:{port}", record)

    async def shed() -> dict[str, Any] | None:
        now = await route()
        return now if now and now["classes"][1]["state"] == "shed" else None

    busy = await poll(shed, message="batch to be shed")
    assert busy["pressure"] == 2.5 and busy["level"] == 1 and busy["levels"] == 1
    assert busy["signals"][0] == {"name": "queue", "mean": 10.0, "bound": 4.0, "pressure": 2.5}
    assert [s["name"] for s in busy["signals"]] == ["queue", "kvCache"]
    assert busy["classes"][1]["admitted"] == 0.0
    assert saturated_at <= busy["classes"][1]["since"] <= time.time()
    assert busy["classes"][0]["state"] == "admitted" and busy["classes"][0]["since"] is None
    view = (await api.http.get("/v1/admission", headers=READ)).json()
    saturation = view["policies"][0]["saturation"]
    assert (saturation["high"], saturation["low"], saturation["queue"]) == (1.0, 0.5, 4.0)
    assert (await api.http.get("/v1/admission", headers={"Authorization": ""})).status_code == 401
    status = (await api.http.get("/v1/status", headers=READ)).json()
    assert status["restrictedClasses"] == [
        {"route": "main/all", "class": "batch", "state": "shed", "admitted": 0.0}
    ]


async def test_whoami_and_the_console_page(api: Harness) -> None:
    assert (await api.http.get("/v1/whoami", headers=READ)).json() == {
        "name": "viewer",
        "role": "read",
    }
    assert (await api.http.get("/v1/whoami", headers={"Authorization": ""})).status_code == 401
    page = await api.http.get("/ui/")
    assert page.status_code == 200 and "kvpilot console" in page.text
    assert (await api.http.get("/ui")).status_code in (307, 308)
    script = await api.http.get("/ui/console.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]


async def test_preview_lists_the_envoy_resources_a_change_would_touch(api: Harness) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat", [8001]))
    await api.http.put("/v1/routingpolicies/main", json=telemetry_policy())
    changed = pool("chat", [8001])
    changed["spec"]["endpoints"][0]["weight"] = 700
    response = await api.http.post("/v1/preview", json={"objects": [changed]}, headers=READ)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["objects"] == [{"kind": "Pool", "name": "chat", "outcome": "configured"}]
    assert [(c["type"], c["name"], c["change"]) for c in result["changes"]] == [
        ("endpoints", "main/all", "changed")
    ]
    bad = await api.http.post("/v1/preview", json={"objects": [{"kind": "Pool"}]}, headers=READ)
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"].startswith("objects[0].")
    assert (await api.http.post("/v1/preview", json=[], headers=READ)).status_code == 400
    assert (await api.http.get("/v1/pools/chat")).json()["spec"]["endpoints"][0]["weight"] == 100


async def test_status_names_etcd_and_the_default_fleet(api: Harness) -> None:
    status = (await api.http.get("/v1/status", headers=READ)).json()
    assert status["etcd"]["endpoints"] == api.client.endpoints
    assert status["etcd"]["embedded"] is False
    assert status["lastBuild"]["defaultFleet"] == "default"
